"""The chaos drill's heal faults (``--chaos N --heal``): the ``heal`` invariant with values
alone, the catalogue and configuration ``--heal`` decides, and a bounded real run of
``tierckpt drill --chaos 5 --heal --preempt`` on examples/train.py (3 ranks under
``tierckpt run``, real SIGKILLs of ranks and of a replacement while it loads, termination
notices through the heal launcher, at-rest damage between them) whose report must show no
violation."""

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
from tierckpt.drill.chaos import ChaosConfig
from tierckpt.drill.chaos_heal import heal_catalogue, heal_verdict
from tierckpt.drill.chaos_report import render_chaos_markdown
from tierckpt.errors import ConfigError

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"
SMALL = ["--layers", "1", "--dim", "32", "--samples", "256", "--save-every", "3",
         "--timeout", "60", "--verify", "full"]
ALL3 = {0: 8, 1: 8, 2: 8}


# --- the heal invariant ----------------------------------------------------------------------

def test_a_heal_or_a_restart_that_resumed_the_newest_commit_passes() -> None:
    v = heal_verdict(variant="mid_step", outcome="heal", chosen=ALL3, world=3,
                     newest_before=8, committed={2, 5, 8})
    assert v.ok and v.name == "heal" and "every rank restored step 8" in v.detail
    assert heal_verdict(variant="mid_heal", outcome="restart", chosen=ALL3, world=3,
                        newest_before=5, committed={2, 5, 8}).ok  # 8 committed after the kill


@pytest.mark.parametrize("kw, word", [
    ({"outcome": "restart"}, "expected a heal"),  # a heal that fell back
    ({"variant": "replacement"}, "expected a restart"),  # must fall back, did not
    ({"outcome": "stalled"}, "ended in stalled"),
    ({"chosen": {0: 8, 1: 8}}, "ranks [2] restored nothing"),
    ({"chosen": {0: 8, 1: 8, 2: 5}}, "different steps"),
    ({"chosen": {0: 9, 1: 9, 2: 9}}, "never committed"),
    ({"chosen": {0: None, 1: None, 2: None}}, "never committed"),  # started from scratch
    ({"newest_before": 11, "committed": {2, 5, 8, 11}}, "older than step 11"),
])
def test_the_heal_invariant_fails_for_each_wrong_end(kw: dict[str, Any], word: str) -> None:
    args: dict[str, Any] = {"variant": "mid_step", "outcome": "heal", "chosen": ALL3,
                            "world": 3, "newest_before": 8, "committed": {2, 5, 8}, **kw}
    v = heal_verdict(**args)
    assert not v.ok and word in v.detail, v.detail


# --- what --heal decides -------------------------------------------------------------------

def test_heal_draws_heal_kill_on_one_node_with_each_variant() -> None:
    plan = cv.draw_plan(5, 60, nodes=1, kinds=["heal_kill", "damage", "partial_commit"])
    variants = {f.variant for p in plan for f in p.faults if f.kind == "heal_kill"}
    assert variants == set(cv.HEAL_OUTCOMES)
    assert all(f.node == 0 for p in plan for f in p.faults)
    assert "heal_kill" in cv.LIVE and "heal_kill" not in cv.RESTART_KINDS  # the job goes on
    assert not any("heal_kill" in p.kinds for p in cv.draw_plan(5, 60, nodes=2))  # asked for
    with_notices = cv.draw_plan(1, 200, nodes=1,
                                kinds=["heal_kill", "damage", *sorted(cv.NOTICE_KINDS)])
    # a notice sent to a rank killed before it acts on it is lost, and the job heals on
    assert not any("heal_kill" in p.kinds and set(p.kinds) & cv.NOTICE_KINDS
                   for p in with_notices)
    assert {frozenset(p.kinds) for p in with_notices if len(p.faults) == 2} >= {
        frozenset({"heal_kill", "damage"}), frozenset({"notice_in_save", "damage"})}


def test_the_catalogue_with_and_without_heal() -> None:
    off = heal_catalogue(False, {})
    assert off == {"heal_kill": {"injectable": False, "how": "not asked for: give --heal"}}
    on = heal_catalogue(True, {"kill_rank": {"injectable": True, "how": "x"},
                               "wipe_ram": {"injectable": False, "how": "no tier 0"}})
    assert on["heal_kill"]["injectable"]
    assert not on["kill_rank"]["injectable"] and "heal_kill" in on["kill_rank"]["how"]
    assert not on["tier1_full"]["injectable"]
    assert not set(on) & cv.NOTICE_KINDS  # as --preempt decides: the launcher forwards them
    assert "wipe_ram" not in on  # already left out, for its own reason


def test_heal_config_needs_one_node_three_ranks_and_no_tier0(tmp_path: Path) -> None:
    cfg = ChaosConfig(command=("python", "t.py"), cycles=2, nnodes=1, nproc=3, heal=True,
                      out=tmp_path)
    assert cfg.world_size == 3 and cfg.heal
    for bad, word in (({"nnodes": 2}, "one node"), ({"nproc": 2}, "nproc >= 3"),
                      ({"tier0": "auto"}, "drop --tier0")):
        with pytest.raises(ConfigError, match=word):
            ChaosConfig(**{"command": ("python", "t.py"), "cycles": 2, "nnodes": 1,  # type: ignore[arg-type]
                           "nproc": 3, "heal": True, **bad})


@pytest.mark.parametrize("args, word", [
    (["--nnodes", "2"], "one node"), (["--nproc", "2"], "nproc >= 3"),
    (["--tier0", "auto"], "drop --tier0")])
def test_bad_chaos_heal_flags_exit_2(tmp_path: Path, args: list[str], word: str) -> None:
    res = CliRunner().invoke(load_commands(), ["drill", "--chaos", "2", "--heal", *args,
                                               "--out", str(tmp_path), "--", "python", "t.py"])
    assert res.exit_code == 2 and word in res.output, res.output


# --- a real run ----------------------------------------------------------------------------

SEED = 2068
"""5 cycles on 3 ranks, with --preempt: a rank and then its replacement while it loads (the
launcher's full restart); a rank killed once its save is staged, then the newest marker
removed at rest; two ranks killed at once; SIGTERM to the launcher then SIGKILL of the ranks
once the emergency save began, with a shard removed at rest; SIGTERM to the launcher as a
save is written, with a shard byte flipped at rest."""


@pytest.mark.slow
@pytest.mark.timeout(480)  # about 1 minute on 2 cores
def test_chaos_drill_with_heal_and_notices_five_cycles_without_a_violation(
        tmp_path: Path) -> None:
    # 120 steps: the five cycles end by about step 40 (each waits for events: a step logged,
    # a save staged, a heal done); the rest only lengthens the reference and the final run
    args = ["drill", "--chaos", "5", "--heal", "--preempt", "--seed", str(SEED), "--kinds",
            "damage,partial_commit,notice_one_rank,notice_then_kill,notice_in_save,heal_kill",
            "--steps", "120", "--out", str(tmp_path), "--json", "--", sys.executable,
            str(EXAMPLE), *SMALL]
    result = CliRunner().invoke(load_commands(), args, catch_exceptions=False)
    doc = json.loads((tmp_path / "chaos-report.json").read_text())
    assert result.exit_code == 0, json.dumps(doc["violations"] or doc["error"], indent=1)
    assert doc["ok"] and doc["config"]["heal"] and doc["config"]["world_size"] == 3
    heals = [f for c in doc["cycles"] for f in c["faults"] if f["kind"] == "heal_kill"]
    assert [(f["variant"], f["landed"]) for f in heals] == [
        ("replacement", "restart"), ("mid_save", "heal"), ("two_at_once", "heal")]
    assert len(heals[2]["ranks"]) == 2
    assert all(f["R_s"] > 0 and f["restored_step"] is not None for f in heals)
    assert all(f["heal_s"] > 0 for f in heals if f["landed"] == "heal")
    notices = {f["kind"] for c in doc["cycles"] for f in c["faults"]} & cv.NOTICE_KINDS
    assert notices == {"notice_then_kill", "notice_in_save"}
    for cyc in doc["cycles"]:
        assert cyc["violations"] == [] and {"losses", "crash_loop"} <= set(cyc["verdicts"])
        kinds = {f["kind"] for f in cyc["faults"]}
        if "heal_kill" in kinds:
            assert "heal" in cyc["verdicts"]
        if kinds & {"damage", "partial_commit"} or kinds & cv.NOTICE_KINDS:  # went down
            assert cyc["resumed"] and {"resume", "integrity", "retained"} <= set(
                cyc["verdicts"])
    assert "lost_work" in doc["cycles"][4]["verdicts"]  # the notice in a save lost nothing
    assert doc["totals"]["faults_by_kind"]["heal_kill"] == 3
    assert (tmp_path / "chaos-report.md").read_text() == render_chaos_markdown(doc)
    assert "heal_kill(two_at_once)@node0 → heal" in render_chaos_markdown(doc)
    assert cf.processes(str(tmp_path / "runs" / "chaos" / "node")) == []
