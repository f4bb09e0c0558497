"""When the job saves under ``CheckpointManager(interval=...)``: the schedule of
:mod:`tierckpt.policy.interval`, the step timing it needs, and the collective hand-off that
keeps every rank's answer the same."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tierckpt.policy import interval
from tierckpt.policy.interval import AutoInterval, Every, Policy, Schedule
from tierckpt.runtime import events, interval_inputs
from tierckpt.runtime.topology import Comm


class Cadence:
    """``should_save(step)`` is local and cheap; ``saved(step)`` — called by ``save()``, so
    collective — has rank 0 decide τ (from this root's events for an
    :class:`AutoInterval`), turn it into the next save step with the measured seconds per
    step, log ``interval_decided``, and broadcast the step. ``clock``: monotonic seconds
    (the seconds per step come from it; injectable for tests)."""

    def __init__(self, policy: Policy, comm: Comm, log: events.EventLog,
                 events_path: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.schedule = Schedule(policy)
        self.comm, self.log, self.events_path, self.clock = comm, log, events_path, clock
        self._last: tuple[int, float] | None = None  # (step, monotonic time) of the last save

    @property
    def policy(self) -> Policy:
        return self.schedule.policy

    def should_save(self, step: int) -> bool:
        if self._last is None:  # the first step this incarnation trains
            self.schedule.start(step)
            self._last = (step - 1, self.clock())
        return self.schedule.should_save(step)

    def saved(self, step: int) -> None:
        if isinstance(self.policy, Every) and self.policy.steps is not None:
            return
        now = self.clock()
        last = self._last
        step_s = (now - last[1]) / (step - last[0]) if last and step > last[0] else None
        self._last = (step, now)
        nxt = None
        if self.comm.rank == 0:
            inputs = interval_inputs.gather(self.policy, self.events_path,
                                            world_size=self.comm.world_size) \
                if isinstance(self.policy, AutoInterval) else None
            decision = interval.decide(self.policy, inputs)
            nxt = self.schedule.after_save(step, decision.interval_s, step_s)
            self.log.emit(events.INTERVAL_DECIDED, step=step, step_s=step_s, next_step=nxt,
                          **decision.to_json())
        self.schedule.next_step = self.comm.broadcast(nxt)
