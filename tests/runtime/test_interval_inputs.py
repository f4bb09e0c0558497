"""The auto interval's inputs from a real event log: restarts count as failures unless the
incarnation before ended with a committed emergency save on a notice."""

from __future__ import annotations

from pathlib import Path

from tierckpt.policy.interval import AutoInterval
from tierckpt.runtime import events as ev
from tierckpt.runtime.interval_inputs import gather


def _log(path: Path, ends: list[str]) -> None:
    """One incarnation per entry of ``ends`` (how it ended: ``kill``, ``preempted``,
    ``notice_only`` (a notice, then killed before its save), ``empty_save`` (preempt_saved
    naming no tier)), then a last one still running. Ranks 0 and 1 log into one file."""
    logs = [ev.EventLog(path, rank=0), ev.EventLog(path, rank=1)]
    t = 1000.0
    for n, end in enumerate([*ends, "running"]):
        pid = 100 + n
        for log in logs:
            log.emit(ev.PROCESS_START, t=t, pid=pid + 1000 * log.rank, restart_count=n)
            log.emit(ev.FIRST_STEP, step=10 * n, t=t + 5, pid=pid + 1000 * log.rank,
                     seconds_since_process_start=5.0)
        if end in ("preempted", "notice_only", "empty_save"):
            for log in logs:
                log.emit(ev.PREEMPT_NOTICE, t=t + 50, pid=pid + 1000 * log.rank,
                         source="signal:SIGTERM", received_unix=t + 50,
                         deadline_unix=t + 80, detail="")
        if end in ("preempted", "empty_save"):
            for log in logs:
                log.emit(ev.PREEMPT_STOP, step=10 * n + 5, t=t + 51,
                         pid=pid + 1000 * log.rank, source="signal:SIGTERM", notice_s=1.0,
                         deadline_unix=t + 80)
                log.emit(ev.PREEMPT_SAVED, step=10 * n + 5, t=t + 55,
                         pid=pid + 1000 * log.rank,
                         reached=["tier1"] if end == "preempted" else [],
                         abandoned={} if end == "preempted" else {"tier1": "no grace"},
                         seconds=5.0, remaining_s=25.0)
        if end == "kill":
            logs[0].emit(ev.FAILURE_DETECTED, t=t + 60, pid=9, how="kill", detail="")
        t += 100
    for log in logs:
        log.close()


def _failures(tmp_path: Path, ends: list[str]) -> int:
    path = tmp_path / "events.jsonl"
    _log(path, ends)
    return gather(AutoInterval(node_mtbf="30d"), path, world_size=2, now=5000.0).failures


def test_every_restart_is_a_failure_without_notices(tmp_path: Path) -> None:
    assert _failures(tmp_path, ["kill", "kill"]) == 2


def test_a_preemption_whose_save_committed_is_not_a_failure(tmp_path: Path) -> None:
    assert _failures(tmp_path, ["kill", "preempted", "kill", "preempted"]) == 2


def test_a_notice_without_a_committed_save_still_counts(tmp_path: Path) -> None:
    assert _failures(tmp_path, ["notice_only", "empty_save", "preempted"]) == 2


def test_no_log_no_failures(tmp_path: Path) -> None:
    inputs = gather(AutoInterval(), tmp_path / "events.jsonl", world_size=1, now=1.0)
    assert inputs.failures == 0
