"""``tierckpt plan --notice``: is a grace period enough for the emergency save, from a real
tier-1 root's events or from stated sizes and rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.runtime import events as ev

from ._helpers import invoke, invoke_json

GB = 10**9


def _run(root: Path, *, tier0: bool = False) -> Path:
    """A tier-1 root whose events.jsonl holds what a 2-rank job on one node writes: three
    saves of 10 GB per rank (tier-1 writes of 10, 12 and 11 s), two uploads (80 s and 100 s
    for 20 GB) and progress marks one second per step."""
    path = root / "events.jsonl"
    logs = [ev.EventLog(path, rank=0), ev.EventLog(path, rank=1)]
    t = 1000.0
    for i, step in enumerate((100, 200, 300)):
        write_s = (10.0, 12.0, 11.0)[i]
        for rank, log in enumerate(logs):
            log.emit(ev.SAVE_STAGED, step=step, t=t, seconds=(2.0, 2.5)[rank], bytes=10 * GB)
            log.emit(ev.SAVE_DURABLE, step=step, t=t + 8, seconds=6.0 + rank, bytes=10 * GB,
                     tier="tier0" if tier0 else "tier1")
            if tier0:
                log.emit(ev.TIER0_SAVED, step=step, t=t + 3, bytes=10 * GB,
                         seconds=(1.0, 2.0)[rank])
            log.emit(ev.SAVE_COMMITTED, step=step, t=t + write_s, seconds=write_s + 2,
                     write_seconds=write_s, bytes=20 * GB, tier="tier1")
        if i < 2:
            logs[0].emit(ev.UPLOAD_STARTED, step=step, t=t + 20, bytes=20 * GB)
            logs[0].emit(ev.UPLOAD_VERIFIED, step=step, t=t + 100, bytes=20 * GB,
                         seconds=(80.0, 100.0)[i])
        for k in range(3):
            logs[0].emit(ev.PROGRESS, step=step + 10 * k, t=t + 200 + 10 * k)
        t += 1000
    logs[0].emit(ev.SAVE_COMMITTED, step=300, t=t, seconds=0.0, write_seconds=0.0,
                 bytes=20 * GB, tier="tier1", flushed=True)  # close()'s flush: no rate
    for log in logs:
        log.close()
    return root


def test_measured_from_a_tier1_root(tmp_path: Path) -> None:
    root = _run(tmp_path)
    doc = invoke_json("plan", "--notice", "30s", "--notice", "120s", "--tier1", str(root))
    assert set(doc) == {"notice"}  # no MTBF: the notice plan alone
    n = doc["notice"]
    inp = n["inputs"]
    assert inp["bytes_per_node"] == 20 * GB
    assert inp["tiers"] == ["tier1", "tier2"]
    assert inp["rates_bps"]["tier1"] == pytest.approx(20 * GB / 12.0)  # the slowest write
    assert inp["rates_bps"]["tier2"] == pytest.approx(20 * GB / 100.0)  # the slowest upload
    assert (inp["stop_s"], inp["stage_s"], inp["margin_s"]) == (1.0, 2.5, 2.0)
    assert all(n["sources"][k].startswith("measured")
               for k in ("bytes_per_node", "tier1_rate", "tier2_rate", "stop_s", "stage_s"))
    short, long = n["plans"]
    assert short["grace_s"] == 30.0 and short["durable"] == "tier1"
    assert [link["reached"] for link in short["links"]] == [True, False]
    assert short["links"][0]["end_s"] == pytest.approx(3.5 + 12.0)
    assert short["needed_s"] == pytest.approx(3.5 + 12.0 + 100.0 + 2.0)
    assert short["verdict"] == ("30 s reaches tier 1; tier 2 needs 118 s: ask for "
                                "--signal=B:USR1@118 or terminationGracePeriodSeconds: 118")
    assert long["durable"] == "tier2"
    assert long["verdict"].startswith("120 s reaches tier 2, every tier")
    assert n["unknown"] == [] and n["notes"] == []


def test_table_and_verdict_in_text(tmp_path: Path) -> None:
    result = invoke("plan", "--notice", "30s", "--tier1", str(_run(tmp_path)))
    assert result.exit_code == 0, result.output
    for fragment in ("20.0 GB per node", "notice with 30 s of grace", "tier 1", "tier 2",
                     "reached", "terminationGracePeriodSeconds: 118", "measured"):
        assert fragment in result.stdout


def test_tier0_run_puts_tier0_first(tmp_path: Path) -> None:
    doc = invoke_json("plan", "--notice", "30s", "--tier1", str(_run(tmp_path, tier0=True)))
    inp = doc["notice"]["inputs"]
    assert inp["tiers"] == ["tier0", "tier1", "tier2"]
    assert inp["rates_bps"]["tier0"] == pytest.approx(20 * GB / 2.0)  # slowest rank 2 s
    # tier 1 is the write less tier 0's part: 12 s - 2 s for the slowest save
    assert inp["rates_bps"]["tier1"] == pytest.approx(20 * GB / 10.0)
    links = doc["notice"]["plans"][0]["links"]
    assert [link["tier"] for link in links] == ["tier0", "tier1", "tier2"]
    assert links[1]["start_s"] == pytest.approx(3.5 + 2.0)


def test_stated_sizes_and_rates() -> None:
    doc = invoke_json("plan", "--notice", "30s", "--notice", "2m", "--size-per-node", "40GB",
                      "--tier1-rate", "2GB/s", "--tier2-rate", "500MB/s", "--step-time",
                      "1.5s", "--blocking", "3s", "--margin", "0s")
    n = doc["notice"]
    assert n["sources"] == {"bytes_per_node": "given", "tier1_rate": "given",
                            "tier2_rate": "given", "stop_s": "given", "stage_s": "given",
                            "margin_s": "given"}
    short, long = n["plans"]
    assert short["links"][0] == {"tier": "tier1", "start_s": 4.5, "end_s": 24.5,
                                 "needed_s": 24.5, "reached": True, "why": ""}
    assert short["verdict"].endswith("tier 2 needs 105 s: ask for --signal=B:USR1@105 or "
                                     "terminationGracePeriodSeconds: 105")
    assert long["grace_s"] == 120.0 and long["durable"] == "tier2"


def test_flags_win_over_measurements(tmp_path: Path) -> None:
    doc = invoke_json("plan", "--notice", "30s", "--tier1", str(_run(tmp_path)),
                      "--tier2-rate", "1GB/s", "--step-time", "0.5s")
    n = doc["notice"]
    assert n["inputs"]["rates_bps"]["tier2"] == 1e9 and n["sources"]["tier2_rate"] == "given"
    assert n["inputs"]["stop_s"] == 0.5
    assert n["sources"]["tier1_rate"].startswith("measured")


def test_unknown_rate_says_how_to_give_it() -> None:
    args = ("plan", "--notice", "30s", "--size-per-node", "10GB", "--tier1-rate", "1GB/s")
    doc = invoke_json(*args)
    n = doc["notice"]
    assert n["inputs"]["rates_bps"]["tier2"] is None
    plan = n["plans"][0]
    assert plan["links"][1]["end_s"] is None and plan["needed_s"] is None
    assert "tier 2: rate unknown: give --tier2-rate" in plan["verdict"]
    assert any("--tier2-rate" in u for u in n["unknown"])
    assert any("--step-time" in note for note in n["notes"])
    result = invoke(*args)
    assert result.exit_code == 0
    assert "unknown" in result.stdout and "--tier2-rate" in result.stdout


def test_with_an_mtbf_the_interval_plan_too(tmp_path: Path) -> None:
    doc = invoke_json("plan", "--notice", "30s", "--tier1", str(_run(tmp_path)),
                      "--restart", "5m", "--job-mtbf", "12h")
    assert doc["inputs"]["C_s"] == 2.5  # the interval's C from the same root's events
    assert doc["interval_s"] > 0 and doc["notice"]["plans"][0]["durable"] == "tier1"


@pytest.mark.parametrize(("args", "fragment"), [
    (("--notice", "30s", "--tier1-rate", "1GB/s"), "--size-per-node"),
    (("--notice", "30s", "--size-per-node", "1GB", "--tier1-rate", "1GB"), "--tier1-rate"),
    (("--notice", "30s", "--size-per-node", "1GB", "--tier2-rate", "fast"), "--tier2-rate"),
    (("--notice", "soon", "--size-per-node", "1GB"), "--notice"),
    (("--notice", "30s", "--size-per-node", "1GB", "--margin", "-1s"), "--margin"),
    (("--job-mtbf", "12h", "--blocking", "5s", "--restart", "1m", "--tier1-rate", "1GB/s"),
     "only used with --notice"),
    (("--notice", "30s", "--tier1", "/nonexistent/root"), "not a tier-1 root"),
])
def test_bad_input_exits_2_naming_the_flag(args: tuple[str, ...], fragment: str) -> None:
    result = invoke("plan", *args)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert result.stdout == ""


def test_tier1_and_from_events_together_is_an_error(tmp_path: Path) -> None:
    root = _run(tmp_path)
    result = invoke("plan", "--notice", "30s", "--tier1", str(root), "--from-events",
                    str(root / "events.jsonl"))
    assert result.exit_code == 2 and "not both" in result.stderr
