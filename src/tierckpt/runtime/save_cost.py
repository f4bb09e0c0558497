"""What a save costs the training loop in all: the time ``save()`` and the step pre-hook
block (C, ``save_staged``) plus the steps that ran slower while the save was copied and
written in the background (memory bandwidth, cores and the GIL are shared with training).

With ``staging="overlap"`` C is a few milliseconds, so an interval planned from C alone
would save far too often: the cost moved into slower steps. :class:`SaveCostMeter` measures
it from step marks: ``should_save(step)`` under ``interval=``, else every ``step()`` of the
state's optimizer (the manager's step pre-hook):

    cost = (first step mark after the save committed − save() entry) − n × idle step time

where ``n`` is the number of steps marked in that window and the idle step time is the
median of the last ``IDLE_WINDOW`` steps with no save in flight. It is emitted per rank as
``save_cost`` (``seconds``, ``window_s``, ``steps``, ``step_s``) once at least
``MIN_IDLE`` idle steps were seen; it can come out below C (or negative) when step times are
noisy — readers take ``max(C, cost)`` per save (:func:`tierckpt.policy.costs.per_save`).
A loop with neither (no interval, no optimizer in the ``TrainState``) gives no
``save_cost``; C alone is then used.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Any

from tierckpt.runtime import events

IDLE_WINDOW = 32
MIN_IDLE = 3


@dataclasses.dataclass
class _Window:
    step: int
    start: float
    steps: int = 0


class SaveCostMeter:
    """Fed ``mark(busy)`` once per training step and ``saving(step, started)`` by each
    ``save()``; emits ``save_cost`` when a save's window closes. ``clock`` is monotonic
    seconds (injectable for tests). Not thread-safe: the training thread calls it."""

    def __init__(self, log: events.EventLog, *, clock: Any = time.monotonic) -> None:
        self.log, self.clock = log, clock
        self._prev: float | None = None
        self._idle: collections.deque[float] = collections.deque(maxlen=IDLE_WINDOW)
        self._open: _Window | None = None

    def mark(self, busy: bool) -> None:
        """A training step just completed; ``busy``: a save is still in flight."""
        now = self.clock()
        prev, self._prev = self._prev, now
        w = self._open
        if w is not None:
            w.steps += 1
            if not busy:
                self._close(w, now)
        elif prev is not None:
            self._idle.append(now - prev)

    def saving(self, step: int, started: float) -> None:
        """``save(step)`` was entered at ``started`` (``clock`` seconds). A window still
        open (no step marked since its save committed) closes there."""
        if self._open is not None:
            self._close(self._open, started)
        self._open = _Window(step=step, start=started)

    def _close(self, w: _Window, end: float) -> None:
        self._open = None
        self._prev = end
        if len(self._idle) < MIN_IDLE or w.steps == 0:
            return
        step_s = statistics.median(self._idle)
        window = end - w.start
        self.log.emit(events.SAVE_COST, step=w.step, seconds=window - w.steps * step_s,
                      window_s=window, steps=w.steps, step_s=step_s)
