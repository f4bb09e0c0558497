"""The training loop's steps as the manager sees them, without a watchdog: what the goodput
report (:mod:`tierckpt.policy.goodput`) and the save-cost meter need.

Steps are known exactly where the loop names them (``should_save(step)``, ``save(step)``,
and the step ``restore()`` returned) and counted from the last known one at each
``optimizer.step()`` of the state's optimizer otherwise (the manager's step pre-hook: that
step's forward and backward are done). Emitted per rank: ``first_step`` once per process
(the first step this process trained, with ``seconds_since_process_start``) and
``progress`` at most every ``PROGRESS_EVERY_S`` (the step just completed). A
:class:`~tierckpt.runtime.watchdog.StepWatchdog` emits the same events; the report reads
whichever come first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from tierckpt.runtime import events
from tierckpt.runtime.distributed import generation, process_started_at
from tierckpt.runtime.save_cost import SaveCostMeter


class StepMarks:
    """Fed by the training thread: :meth:`anchor` where the step is known, :meth:`completed`
    once per training step. Feeds ``meter`` (a save's cost from step marks) too."""

    def __init__(self, log: events.EventLog, meter: SaveCostMeter) -> None:
        self.log, self.meter = log, meter
        self._marks = events.ProgressMarks(log)
        self._step: int | None = None
        self._first_done = False

    def anchor(self, step: int) -> None:
        """``step`` is the last completed step (a save's, or the one restored; -1: none)."""
        self._step = step

    def saving(self, step: int, started: float) -> None:
        """``save(step)`` was entered at ``started`` (monotonic seconds)."""
        self.meter.saving(step, started)
        self._step = step

    def completed(self, *, busy: bool, step: int | None = None) -> None:
        """A training step completed (``step`` when the loop named it, else the one after
        the last known); ``busy``: a save is still in flight."""
        self.meter.mark(busy=busy)
        if step is None:
            if self._step is None:  # no step known yet: nothing to count from
                return
            step = self._step + 1
        self._step = step
        if not self._first_done:
            self._first_done = True
            emit_first_step(self.log, step)
        self._marks.step(step)


_FIRST_STEP_LOGS: set[tuple[int, str, int]] = set()


def emit_first_step(log: events.EventLog, step: int) -> None:
    """Emit ``first_step`` into ``log`` once per process and log file, whoever sees the
    first step first (the manager's marks or a StepWatchdog)."""
    key = (os.getpid(), str(log.path.resolve()), generation())  # once more after a heal
    if key in _FIRST_STEP_LOGS:
        return
    _FIRST_STEP_LOGS.add(key)
    started = process_started_at()
    log.emit(events.FIRST_STEP, step=step, seconds_since_process_start=(
        None if started is None else time.time() - started))
    for hook in _FIRST_STEP_HOOKS:
        hook()


_FIRST_STEP_HOOKS: list[Callable[[], None]] = []


def on_first_step(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever :func:`emit_first_step` records a process's first step of a
    generation: how a wing that needs that moment (the heal launcher's ``stepped`` count,
    :func:`tierckpt.heal.regroup.mark_stepped`) learns of it without this module importing
    the wing. Registering the same hook twice calls it once."""
    if hook not in _FIRST_STEP_HOOKS:
        _FIRST_STEP_HOOKS.append(hook)
