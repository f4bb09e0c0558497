"""The preemption drill: its pure verdicts with values; ``tierckpt drill --preempt`` end to
end on examples/train.py (2 ranks, real torchrun, a real SIGTERM to the launcher, or SIGUSR1
to one rank), whose report must show one stop step, nothing lost, bit-identical losses and
a verified checkpoint; and the chaos drill's notice kinds (``--chaos 3 --preempt``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tierckpt.cli._app import load_commands
from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill import preempt_verdicts as pv
from tierckpt.drill.chaos import ChaosConfig
from tierckpt.drill.preempt import PreemptConfig
from tierckpt.drill.preempt_report import render_preempt_markdown
from tierckpt.errors import ConfigError
from tierckpt.preempt.config import EXIT_PREEMPTED

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"
SMALL = ["--layers", "1", "--dim", "32", "--samples", "256", "--save-every", "3",
         "--timeout", "60"]


def _ev(kind: str, t: float, rank: int, **kw: Any) -> dict[str, Any]:
    return {"event": kind, "t": t, "rank": rank, **kw}


# --- where the notice goes -------------------------------------------------------------------

def test_notice_is_seeded_from_step_1_to_a_few_steps_before_the_end() -> None:
    plans = {pv.choose_notice(s, steps=12, world_size=2) for s in range(60)}
    assert {p.step for p in plans} == set(range(1, 8))
    assert {(p.rank, p.signal) for p in plans} == {(None, "SIGTERM")}
    one = pv.choose_notice(4, steps=12, world_size=2, rank=1)
    assert (one.rank, one.signal) == (1, "SIGUSR1")
    assert one.step == pv.choose_notice(4, steps=12, world_size=2).step  # same seed, same step


@pytest.mark.parametrize("kw", [{"steps": 5}, {"rank": 2}, {"rank": -1}])
def test_a_notice_that_cannot_be_placed_names_what_to_change(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"--steps|--preempt-rank"):
        pv.choose_notice(0, **{"steps": 12, "world_size": 2, **kw})


def test_preempt_config_validates(tmp_path: Path) -> None:
    cfg = PreemptConfig(command=("python", "t.py"), out=tmp_path)
    assert cfg.tier2 == f"file://{tmp_path / 'tier2'}" and cfg.world_size == 2
    assert cfg.roots("preempt") == (tmp_path / "runs" / "preempt" / "tier1",)
    for bad in ({"command": ()}, {"steps": 4}, {"nproc": 0}, {"rank": 2}, {"rtol": -1.0},
                {"tier2": "s3://b:9000/p"}):
        with pytest.raises(ConfigError):
            PreemptConfig(**{"command": ("python", "t.py"), **bad})  # type: ignore[arg-type]


# --- verdicts ---------------------------------------------------------------------------------

STOPS = [_ev("preempt_stop", 10.2, 0, step=7), _ev("preempt_stop", 10.3, 1, step=7)]
SAVED = [_ev("preempt_saved", 10.6, r, step=7, reached=["tier1"], abandoned={},
             remaining_s=29.0 + r) for r in (0, 1)]
EXITS = [_ev("preempt_exit", 10.7, r, step=7, code=EXIT_PREEMPTED) for r in (0, 1)]


def test_stop_passes_only_when_every_rank_stopped_at_one_step() -> None:
    v = pv.stop_verdict(STOPS, world_size=2)
    assert v.ok and v.facts["step"] == 7
    split = pv.stop_verdict([STOPS[0], {**STOPS[1], "step": 8}], world_size=2)
    assert not split.ok and split.facts["step"] is None and "different" in split.detail
    missing = pv.stop_verdict(STOPS[:1], world_size=2)
    assert not missing.ok and "[1]" in missing.detail


def test_saved_needs_the_agreed_step_a_tier_and_exit_75_on_every_rank() -> None:
    assert pv.saved_verdict([*SAVED, *EXITS], step=7, world_size=2, exit_code=75).ok
    for events, word in (([*SAVED, EXITS[0]], "exit code None"),
                         ([SAVED[0], {**SAVED[1], "reached": []}, *EXITS], "expected step 7"),
                         ([SAVED[0], *EXITS], "no preempt_saved")):
        v = pv.saved_verdict(events, step=7, world_size=2, exit_code=75)
        assert not v.ok and word in v.detail, v.detail


def test_lost_work_is_at_most_the_step_in_progress() -> None:
    ok = pv.lost_work_verdict(stop_step=7, seen=6, logged_max=7, resumed_from=7,
                              first_resumed=8)
    assert ok.ok and ok.facts["lost_steps"] == 0 and ok.facts["steps_after_notice"] == 1
    cases: list[tuple[dict[str, Any], str]] = [
        ({"stop_step": 5}, "before step 6"), ({"logged_max": 8}, "step 8 was trained"),
        ({"resumed_from": 4}, "resumed from 4"), ({"first_resumed": 7}, "first step"),
        ({"stop_step": None}, "no stop step"),
        ({"arrived": 4}, "more than one step after step 5")]
    for change, word in cases:
        kw: dict[str, Any] = {"stop_step": 7, "seen": 6, "logged_max": 7, "resumed_from": 7,
                              "first_resumed": 8, **change}
        v = pv.lost_work_verdict(**kw)
        assert not v.ok and word in v.detail, (change, v.detail)
    # the sender's view lags under load (seen 2): the bound is where the ranks were
    late = pv.lost_work_verdict(stop_step=7, seen=2, logged_max=7, resumed_from=7,
                                first_resumed=8, arrived=5)
    assert late.ok and late.facts["arrived_step"] == 5


def test_the_arrival_is_the_step_of_the_first_rank_to_learn_of_the_notice() -> None:
    events = [_ev("preempt_notice", 10.2, 1, received_unix=10.1, step=6),
              _ev("preempt_notice", 10.1, 0, received_unix=10.0, step=5),
              _ev("preempt_notice", 10.0, 2, received_unix=9.0, step=-1),  # before step 0
              _ev("preempt_stop", 10.3, 0, step=7)]
    assert pv.arrival_step(events) == 5
    assert pv.arrival_step(events[2:]) is None  # no rank had reached a step
    assert pv.arrival_step([{k: v for k, v in events[0].items() if k != "step"}]) is None


def test_timings_run_from_the_send_to_each_tier_reached_and_name_the_abandoned() -> None:
    events = [_ev("preempt_notice", 10.05, r, received_unix=10.01 + r / 100) for r in (0, 1)]
    events += [*STOPS, _ev("save_committed", 10.4, 0, step=7, tier="tier1"),
               _ev("save_committed", 9.0, 0, step=4, tier="tier1"),
               _ev("upload_verified", 10.9, 0, step=7),
               {**SAVED[0], "reached": ["tier1", "tier2"]}, SAVED[1]]
    t = pv.notice_timings(events, t_sent=10.0, step=7)
    assert t["reached"] == ["tier1", "tier2"] and t["abandoned"] == {}
    assert t["received_s"] == pytest.approx(0.02) and t["stopped_s"] == pytest.approx(0.3)
    assert t["durable_s"] == {"tier1": pytest.approx(0.4), "tier2": pytest.approx(0.9)}
    assert t["saved_s"] == pytest.approx(0.6) and t["remaining_s"] == 29.0
    cut = {**SAVED[1], "abandoned": {"tier2": "the upload did not finish"}}
    t2 = pv.notice_timings([*events[:-1], cut], t_sent=10.0, step=7)
    assert t2["reached"] == ["tier1"] and "did not finish" in t2["abandoned"]["tier2"]


# --- the chaos catalogue ------------------------------------------------------------------------

def test_notice_kinds_end_a_cycle_alone_and_never_meet_a_full_tier1() -> None:
    for seed in range(200):
        for p in cv.draw_plan(seed, 4, nodes=2, kinds=cv.KINDS, save_every=3):
            kinds = set(p.kinds)
            assert len(kinds & (cv.NOTICE_KINDS | {"kill_rank", "kill_partner"})) <= 1, kinds
            assert not (kinds & cv.NOTICE_KINDS and "tier1_full" in kinds), kinds
            assert not kinds & cv.NOTICE_KINDS or p.restarts


def test_a_seed_draws_its_old_plan_without_preempt(tmp_path: Path) -> None:
    old = cv.KINDS[:10]  # the catalogue before the notice kinds
    assert not set(old) & cv.NOTICE_KINDS
    for seed in (2801, 14, 7):
        assert cv.draw_plan(seed, 12, nodes=2, kinds=old) == cv.draw_plan(
            seed, 12, nodes=2,
            kinds=[k for k in cv.KINDS
                   if k not in cv.NOTICE_KINDS | cv.HEAL_KINDS | cv.OBJECT_KINDS])
    assert not ChaosConfig(command=("python", "t.py"), cycles=1).preempt


def test_send_delivers_a_signal_and_reports_a_gone_process() -> None:
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cf.send(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        assert not cf.send(proc.pid, signal.SIGUSR1)
    finally:
        proc.kill()


@pytest.mark.parametrize("args", [["--preempt", "--preempt-rank", "2"],
                                  ["--preempt-rank", "0"], ["--preempt", "--tier0", "auto"],
                                  ["--preempt", "--steps", "4"],
                                  ["--chaos", "2", "--preempt", "--kinds", "meteor"]])
def test_bad_preempt_flags_exit_2_before_anything_runs(tmp_path: Path, args: list[str]) -> None:
    res = CliRunner().invoke(load_commands(), ["drill", *args, "--out", str(tmp_path), "--",
                                               "python", "t.py"])
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "runs").exists()


# --- end to end ---------------------------------------------------------------------------------

def _drill(out: Path, *extra: str) -> tuple[dict[str, Any], Any]:
    res = CliRunner().invoke(load_commands(), [
        "drill", "--preempt", "--steps", "12", "--out", str(out), "--json", *extra, "--",
        sys.executable, str(EXAMPLE), *SMALL], catch_exceptions=False)
    return json.loads((out / "preempt-report.json").read_text()), res


def _check(doc: dict[str, Any], res: Any) -> None:
    assert res.exit_code == 0, json.dumps(doc["details"], indent=1)[-6000:]
    assert json.loads(res.stdout) == doc  # --json: stdout is the document alone
    assert doc["ok"] and doc["error"] is None
    assert doc["verdicts"] == dict.fromkeys(pv.PREEMPT_VERDICTS, True)
    n, step = doc["notice"], doc["stop_step"]
    arrived = doc["details"]["lost_work"]["facts"]["arrived_step"]
    assert n["planned_step"] <= n["seen"] <= step <= arrived + 2  # at most one step on
    assert doc["lost_steps"] == 0 and doc["steps_after_notice"] == step - n["seen"]
    assert doc["launcher_rc"] != 0  # torchrun exits non-zero after its workers' 75
    lost = doc["details"]["lost_work"]["facts"]
    assert lost["resumed_from"] == step and lost["first_resumed"] == step + 1
    t = doc["timings"]
    assert "tier1" in t["reached"] and t["remaining_s"] > 0
    assert 0 < t["stopped_s"] <= t["saved_s"]  # orderings only: no timing bounds
    assert all(0 < s <= t["saved_s"] for s in t["durable_s"].values())
    assert doc["details"]["continuity"]["facts"]["mismatches"] == []
    assert Path(doc["files"]["md"]).read_text() == render_preempt_markdown(doc)


@pytest.mark.slow
@pytest.mark.timeout(600)  # about a minute on 2 cores: three runs of 12 steps
def test_preempt_drill_sigterm_to_the_launcher(tmp_path: Path) -> None:
    doc, res = _drill(tmp_path, "--seed", "3")
    _check(doc, res)
    assert doc["notice"]["target"] == "launcher" and doc["notice"]["signal"] == "SIGTERM"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_preempt_drill_sigusr1_to_one_rank(tmp_path: Path) -> None:
    doc, res = _drill(tmp_path, "--seed", "5", "--preempt-rank", "1")
    _check(doc, res)
    assert doc["notice"]["target"].startswith("rank 1 pid")
    sources = {r: f for r, f in doc["details"]["saved"]["facts"]["reached"].items()}
    assert set(sources) == {"0", "1"}  # both ranks saved, though one was told


CHAOS_SEED = 13
"""With only the notice kinds (``--kinds`` in sorted order): SIGUSR1 to node 1's rank alone,
a notice then SIGKILL of every rank at once, a notice in node 1's background save through
its launcher."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_notice_kinds_three_cycles_without_a_violation(tmp_path: Path) -> None:
    res = CliRunner().invoke(load_commands(), [
        "drill", "--chaos", "3", "--seed", str(CHAOS_SEED), "--preempt", "--kinds",
        ",".join(sorted(cv.NOTICE_KINDS)), "--steps", "120", "--out", str(tmp_path), "--json",
        "--", sys.executable, str(EXAMPLE), *SMALL, "--verify", "full"],
        catch_exceptions=False)
    doc = json.loads((tmp_path / "chaos-report.json").read_text())
    assert res.exit_code == 0, json.dumps(doc["violations"] or doc["error"], indent=1)
    assert doc["ok"] and doc["config"]["preempt"]
    assert all(doc["catalogue"][k]["injectable"] for k in cv.NOTICE_KINDS)
    assert set(doc["totals"]["faults_by_kind"]) == set(cv.NOTICE_KINDS)  # every kind fired
    assert doc["totals"]["restarts"] == 3
    for cyc in doc["cycles"]:
        (fault,) = cyc["faults"]
        assert {"resume", "integrity", "retained", "losses", "crash_loop"} <= set(
            cyc["verdicts"])
        if fault["kind"] == "notice_then_kill":
            assert fault["killed"] and "lost_work" not in cyc["verdicts"]
        else:  # announced: nothing lost, resumed right after the agreed step
            assert cyc["verdicts"]["lost_work"]["ok"]
            assert fault["seen"] <= fault["stop_step"] <= fault["arrived"] + 2
            assert cyc["resumed"][0]["step"] == fault["stop_step"]
    assert cf.processes(str(tmp_path / "runs" / "chaos" / "node")) == []
