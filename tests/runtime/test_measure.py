"""Measured C, W and R from real event-log files and drill reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierckpt.errors import ConfigError
from tierckpt.runtime import events as ev
from tierckpt.runtime import measure


def _log(path: Path, rank: int, rows: list[tuple[str, int | None, dict[str, object]]]) -> None:
    with ev.EventLog(path, rank=rank) as log:
        for kind, step, fields in rows:
            log.emit(kind, step=step, **fields)


def test_blocking_is_median_over_steps_of_the_slowest_rank(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _log(path, 0, [(ev.SAVE_STAGED, 100, {"seconds": 2.0, "bytes": 1}),
                   (ev.SAVE_STAGED, 200, {"seconds": 3.0, "bytes": 1}),
                   (ev.SAVE_STAGED, 300, {"seconds": 4.0, "bytes": 1})])
    _log(path, 1, [(ev.SAVE_STAGED, 100, {"seconds": 9.0, "bytes": 1}),
                   (ev.SAVE_STAGED, 200, {"seconds": 1.0, "bytes": 1}),
                   (ev.SAVE_STAGED, 300, {"seconds": 5.0, "bytes": 1})])
    m = measure.from_event_log(path)
    assert m.C is not None
    assert m.C.seconds == 5.0  # per step max: 9, 3, 5 → median 5
    assert m.C.samples == 3
    assert "save_staged" in m.C.source
    assert m.W is None and m.R is None


def test_blocking_takes_the_whole_cost_where_the_steps_measured_it(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _log(path, 0, [(ev.SAVE_STAGED, s, {"seconds": 0.01, "bytes": 1}) for s in (1, 2, 3)]
         + [(ev.SAVE_COST, s, {"seconds": 0.4, "window_s": 1.0, "steps": 5, "step_s": 0.12})
            for s in (1, 2)])
    m = measure.from_event_log(path)
    assert m.C is not None and m.C.seconds == 0.4  # 0.4, 0.4, 0.01
    assert "2 with the slower steps" in m.C.source


def test_write_time_is_median_of_committed_write_seconds(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _log(path, 0, [(ev.SAVE_COMMITTED, s, {"seconds": 40.0, "bytes": 1, "write_seconds": w})
                   for s, w in ((1, 30.0), (2, 10.0), (3, 20.0), (4, 25.0))])
    m = measure.from_event_log(path)
    assert m.W is not None and m.W.seconds == 22.5 and m.W.samples == 4


def test_restart_from_detection_to_first_step(tmp_path: Path) -> None:
    """Two failures: detected by two ranks each; R = earliest detection → last first_step."""
    path = tmp_path / "events.jsonl"
    _log(path, 0, [(ev.FAILURE_DETECTED, None, {"t": 1000.0, "how": "kill"}),
                   (ev.PROCESS_START, None, {"t": 1010.0, "restart_count": 1}),
                   (ev.RESTORE_DONE, None, {"t": 1050.0, "seconds": 30.0}),
                   (ev.FIRST_STEP, None, {"t": 1100.0, "seconds_since_process_start": 90.0}),
                   (ev.FAILURE_DETECTED, None, {"t": 5000.0, "how": "watchdog"}),
                   (ev.FIRST_STEP, None, {"t": 5300.0, "seconds_since_process_start": 250.0})])
    _log(path, 1, [(ev.FAILURE_DETECTED, None, {"t": 1003.0, "how": "kill"}),
                   (ev.FIRST_STEP, None, {"t": 1102.0, "seconds_since_process_start": 92.0}),
                   (ev.FAILURE_DETECTED, None, {"t": 5001.0, "how": "watchdog"}),
                   (ev.FIRST_STEP, None, {"t": 5304.0, "seconds_since_process_start": 251.0})])
    m = measure.from_event_log(path)
    assert m.R is not None
    assert m.R.seconds == pytest.approx((102.0 + 304.0) / 2)
    assert m.R.samples == 2
    assert "failure_detected" in m.R.source


def test_restart_falls_back_to_process_start_then_restore_done(tmp_path: Path) -> None:
    recs = [{"event": ev.PROCESS_START, "t": 1.0, "pid": 7, "restart_count": 0},
            {"event": ev.FIRST_STEP, "t": 2.0, "pid": 7, "seconds_since_process_start": 5.0},
            {"event": ev.PROCESS_START, "t": 10.0, "pid": 8, "restart_count": 1},
            {"event": ev.RESTORE_DONE, "t": 11.0, "pid": 8, "seconds": 3.0},
            {"event": ev.FIRST_STEP, "t": 12.0, "pid": 8, "seconds_since_process_start": 60.0}]
    m = measure.from_events(recs)
    assert m.R is not None and m.R.seconds == 60.0  # only the restarted process counts
    assert "process_start" in m.R.source
    only_restore = measure.from_events([recs[3]])
    assert only_restore.R is not None and only_restore.R.seconds == 3.0
    assert "lower bound" in only_restore.R.source


def test_torn_and_garbled_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _log(path, 0, [(ev.SAVE_STAGED, 1, {"seconds": 2.0, "bytes": 1})])
    with open(path, "a") as f:
        f.write('{"event": "save_staged", "seconds": "fast"}\n')  # non-numeric: ignored
        f.write('{"event": "save_staged", "t": 5, "step": 9, "seconds": 4.0')  # torn
    m = measure.from_event_log(path)
    assert m.C is not None and m.C.seconds == 2.0 and m.C.samples == 1


def test_missing_event_log_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--from-events"):
        measure.from_event_log(tmp_path / "nope.jsonl")


def test_drill_report(tmp_path: Path) -> None:
    path = tmp_path / "drill-report.json"
    path.write_text(json.dumps({"drills": [], "measured": {"C_s": 1.5, "W_s": None,
                                                            "R_s": 42.0}}))
    m = measure.from_drill_report(path)
    assert m.C is not None and m.C.seconds == 1.5
    assert m.W is None
    assert m.R is not None and m.R.seconds == 42.0 and "R_s" in m.R.source


@pytest.mark.parametrize(("body", "fragment"), [
    ("not json", "not JSON"),
    (json.dumps({"drills": []}), "measured"),
    (json.dumps({"measured": {"C_s": "fast"}}), "measured.C_s"),
    (json.dumps({"measured": {"R_s": -1}}), "measured.R_s"),
])
def test_bad_drill_report(tmp_path: Path, body: str, fragment: str) -> None:
    path = tmp_path / "drill-report.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match="--from-drill") as info:
        measure.from_drill_report(path)
    assert fragment in str(info.value)


def test_a_later_generation_does_not_stretch_r() -> None:
    """A restart without a logged failure (e.g. a resize) must not count toward the last R."""
    recs = [{"event": ev.FAILURE_DETECTED, "t": 100.0, "pid": 1},
            {"event": ev.PROCESS_START, "t": 110.0, "pid": 2, "restart_count": 1},
            {"event": ev.FIRST_STEP, "t": 160.0, "pid": 2, "seconds_since_process_start": 50.0},
            {"event": ev.PROCESS_START, "t": 9000.0, "pid": 3, "restart_count": 2},
            {"event": ev.FIRST_STEP, "t": 9100.0, "pid": 3, "seconds_since_process_start": 100}]
    m = measure.from_events(recs)
    assert m.R is not None and m.R.seconds == 60.0 and m.R.samples == 1
