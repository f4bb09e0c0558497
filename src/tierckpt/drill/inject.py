"""The kill drill's fault: SIGKILL one rank from outside once a chosen step has completed.

The drill needs nothing from the training script but what tierckpt already records: the
victim's pid comes from its ``process_start`` event (which carries rank and pid), progress
from the losses file. The kill time is appended to the event log as ``failure_detected``
(``how="kill"``), the start of the measured restart cost R.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tierckpt.drill.verdicts import KillPlan
from tierckpt.errors import CheckpointError
from tierckpt.runtime import events as ev

__all__ = ["KillRecord", "kill_at_step", "last_step", "read_jsonl"]

_POLL_S = 0.01


@dataclass(frozen=True)
class KillRecord:
    """What was killed and when: ``t`` wall-clock seconds; ``after_step`` the newest step in
    the losses file right after the kill (the kill may land a step or two after the plan)."""

    planned_step: int
    rank: int
    pid: int
    t: float
    after_step: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Well-formed JSON objects of a JSONL file (a torn last line is skipped); [] if absent."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def last_step(losses: Path) -> int:
    """The newest step in a losses file, -1 when it has none."""
    return max((int(r["step"]) for r in read_jsonl(losses) if isinstance(r.get("step"), int)),
               default=-1)


def _victim_pid(event_logs: Sequence[Path], rank: int) -> tuple[int, Path] | None:
    for log in event_logs:
        for e in read_jsonl(log):
            if (e.get("event") == ev.PROCESS_START and e.get("rank") == rank
                    and e.get("restart_count", 0) == 0 and isinstance(e.get("pid"), int)):
                return int(e["pid"]), log
    return None


def _committed(event_logs: Sequence[Path]) -> bool:
    return any(e.get("event") == ev.SAVE_COMMITTED for log in event_logs
               for e in read_jsonl(log))


def kill_at_step(plan: KillPlan, *, losses: Path, event_logs: Sequence[Path],
                 alive: Callable[[], bool], timeout_s: float) -> KillRecord:
    """Wait until ``plan.step`` is in ``losses`` and a save has committed (saves commit in
    the background, possibly a few steps after the save step: without one there is nothing
    to resume from), SIGKILL rank ``plan.rank`` (first incarnation), and record
    ``failure_detected`` in that rank's event log.

    ``alive()`` says whether the job still runs. CheckpointError when the job ends, or the
    step or the victim's pid does not appear within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    victim = None
    while True:
        if victim is None:
            victim = _victim_pid(event_logs, plan.rank)
        if victim is not None and last_step(losses) >= plan.step and _committed(event_logs):
            break
        if not alive():
            raise CheckpointError(f"kill drill: the job ended before step {plan.step} "
                                  f"(rank {plan.rank} pid found: {victim is not None})")
        if time.monotonic() > deadline:
            raise CheckpointError(f"kill drill: step {plan.step} of rank {plan.rank} not seen "
                                  f"within {timeout_s:.0f} s")
        time.sleep(_POLL_S)
    pid, log_path = victim
    os.kill(pid, signal.SIGKILL)
    t = time.time()
    with ev.EventLog(log_path, rank=plan.rank) as log:
        log.emit(ev.FAILURE_DETECTED, how="kill", detail=f"drill SIGKILLed pid {pid}",
                 victim_pid=pid, source="drill")
    return KillRecord(planned_step=plan.step, rank=plan.rank, pid=pid, t=t,
                      after_step=last_step(losses))
