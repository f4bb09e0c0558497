"""``tierckpt plan`` through the real CLI: the worked example, measured inputs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierckpt.runtime import events as ev

from ._helpers import RUNNER, app, flags, invoke, invoke_json

H = 3600.0


def test_design_example_json_schema() -> None:
    doc = invoke_json("plan", "--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h")
    assert doc["job_mtbf_s"] == 43200.0
    assert round(doc["interval_s"] / 60) == 38
    assert round(100 * doc["waste_fraction"], 1) == 7.4
    assert set(doc["waste_parts"]) == {"ckpt", "rework", "restart"}
    assert sum(doc["waste_parts"].values()) == pytest.approx(doc["waste_fraction"])
    assert doc["daly_interval_s"] < doc["young_interval_s"] == doc["interval_s"]
    assert doc["exact_waste_fraction"] < doc["waste_fraction"]
    assert doc["sources"] == {"C_s": "given", "R_s": "given", "job_mtbf_s": "given"}
    assert doc["warnings"] == [] and doc["resize"] is None
    assert doc["waste_node_days_per_month"] is None  # node count unknown


def test_compare_reproduces_design_md() -> None:
    doc = invoke_json("plan", "--job-mtbf", "12h", "--compare", "sync:C=60s,R=15m",
                      "--compare", "async:C=5s,R=5m")
    rows = {s["name"]: s for s in doc["strategies"]}
    assert list(rows) == ["sync", "async"]
    assert round(rows["sync"]["interval_s"] / 60) == 38
    assert round(100 * rows["sync"]["waste_fraction"], 1) == 7.4
    assert round(rows["async"]["interval_s"] / 60) == 11
    assert round(100 * rows["async"]["waste_fraction"], 1) == 2.2
    result = invoke("plan", "--job-mtbf", "12h", "--compare", "sync:C=60s,R=15m",
                    "--compare", "async:C=5s,R=5m")
    assert result.exit_code == 0
    for fragment in ("sync", "async", "37.9 min", "11.0 min", "7.35 %", "2.22 %"):
        assert fragment in result.stdout


def test_node_mtbf_node_days_and_resize() -> None:
    doc = invoke_json("plan", "--blocking", "5s", "--restart", "5m", "--node-mtbf", "1000d",
                      "--nodes", "2000", "--resize", "4000")
    assert doc["job_mtbf_s"] == pytest.approx(1000 * 86400 / 2000)
    assert doc["waste_node_days_per_month"] == pytest.approx(
        doc["waste_fraction"] * 2000 * 30)
    r = doc["resize"]
    assert r["nodes"] == 4000
    assert r["job_mtbf_s"] == pytest.approx(doc["job_mtbf_s"] / 2)
    assert r["interval_s"] == pytest.approx(doc["interval_s"] / 2**0.5)
    assert r["waste_fraction"] > doc["waste_fraction"]


def test_write_time_longer_than_interval_warns() -> None:
    doc = invoke_json("plan", "--blocking", "5s", "--restart", "5m", "--job-mtbf", "12h",
                      "--write-time", "20m")
    assert doc["overlap"] is True
    assert any("overlap" in w for w in doc["warnings"])
    result = invoke("plan", "--blocking", "5s", "--restart", "5m", "--job-mtbf", "12h",
                    "--write-time", "20m")
    assert "warning" in result.stdout and "faster storage" in result.stdout


def test_from_events_says_what_was_measured(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with ev.EventLog(path) as log:
        for step, c in ((100, 4.0), (200, 6.0), (300, 5.0)):
            log.emit(ev.SAVE_STAGED, step=step, seconds=c, bytes=10)
            log.emit(ev.SAVE_COMMITTED, step=step, seconds=30.0, bytes=10, write_seconds=25.0)
        log.emit(ev.FAILURE_DETECTED, t=1000.0, how="kill")
        log.emit(ev.FIRST_STEP, t=1240.0, seconds_since_process_start=200.0)
    doc = invoke_json("plan", "--from-events", str(path), "--job-mtbf", "12h")
    assert doc["inputs"]["C_s"] == 5.0
    assert doc["inputs"]["W_s"] == 25.0
    assert doc["inputs"]["R_s"] == 240.0
    assert doc["sources"]["C_s"].startswith("measured")
    assert "failure_detected" in doc["sources"]["R_s"]
    assert doc["sources"]["job_mtbf_s"] == "given"
    # a flag overrides the measurement and says so
    doc = invoke_json("plan", "--from-events", str(path), "--job-mtbf", "12h",
                      "--restart", "10m")
    assert doc["inputs"]["R_s"] == 600.0 and doc["sources"]["R_s"] == "given"
    result = invoke("plan", "--from-events", str(path), "--job-mtbf", "12h")
    assert "measured" in result.stdout


def test_from_drill_report(tmp_path: Path) -> None:
    path = tmp_path / "drill-report.json"
    path.write_text(json.dumps({"verdict": "pass",
                                "measured": {"C_s": 2.0, "W_s": 40.0, "R_s": 120.0}}))
    doc = invoke_json("plan", "--from-drill", str(path), "--job-mtbf", "6h")
    assert (doc["inputs"]["C_s"], doc["inputs"]["W_s"], doc["inputs"]["R_s"]) == (2, 40, 120)
    assert all(doc["sources"][k].startswith("measured") for k in ("C_s", "W_s", "R_s"))
    assert doc["interval_s"] == pytest.approx((2 * 2.0 * 6 * H) ** 0.5)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "waste.png"
    result = invoke("plan", "--job-mtbf", "12h", "--compare", "sync:C=60s,R=15m",
                    "--compare", "async:C=5s,R=5m", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize(("args", "fragment"), [
    (("--blocking", "60s", "--restart", "15m"), "missing MTBF"),
    (("--blocking", "-5s", "--restart", "15m", "--job-mtbf", "12h"), "--blocking"),
    (("--blocking", "0s", "--restart", "15m", "--job-mtbf", "12h"), "--blocking"),
    (("--blocking", "5x", "--restart", "15m", "--job-mtbf", "12h"), "unknown duration unit"),
    (("--blocking", "13h", "--restart", "15m", "--job-mtbf", "12h"), "smaller than the job"),
    (("--restart", "15m", "--job-mtbf", "12h"), "missing --blocking"),
    (("--blocking", "5s", "--job-mtbf", "12h"), "missing --restart"),
    (("--blocking", "5s", "--restart", "1m", "--node-mtbf", "30d"), "--nodes"),
    (("--blocking", "5s", "--restart", "1m", "--job-mtbf", "1h", "--node-mtbf", "30d",
      "--nodes", "3"), "not both"),
    (("--blocking", "5s", "--restart", "1m", "--job-mtbf", "1h", "--resize", "9"),
     "--resize"),
    (("--job-mtbf", "1h", "--compare", "fast:C=5s"), "--compare"),
    (("--job-mtbf", "1h", "--compare", "fast:X=5s,R=1m"), "--compare"),
    (("--blocking", "5s", "--restart", "1m", "--job-mtbf", "1h", "--rule", "best"),
     "--rule"),
    (("--job-mtbf", "1h", "--from-events", "/nonexistent/events.jsonl"), "--from-events"),
])
def test_bad_input_exits_2_naming_the_flag(args: tuple[str, ...], fragment: str) -> None:
    result = invoke("plan", *args)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert result.stdout == ""


def test_error_is_red_on_a_colour_terminal() -> None:
    result = RUNNER.invoke(app, ["plan", "--blocking", "5s", "--restart", "1m"],
                           env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert result.exit_code == 2
    assert "\x1b[" in result.stderr and "31m" in result.stderr  # ANSI red


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("plan") == {
        "--blocking", "--compare", "--from-drill", "--from-events", "--job-mtbf",
        "--json", "--node-mtbf", "--nodes", "--plot", "--resize", "--restart", "--rule",
        "--write-time", "--notice", "--tier1", "--size-per-node", "--tier0-rate",
        "--tier1-rate", "--tier2-rate", "--step-time", "--margin"
    }
