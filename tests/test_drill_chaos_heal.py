"""The chaos drill's heal faults (``--chaos N --heal``): the ``heal`` invariant with values
alone, the catalogue and configuration ``--heal`` decides, and a bounded real run of
``tierckpt drill --chaos 4 --heal`` on examples/train.py (3 ranks under ``tierckpt run``,
real SIGKILLs of ranks, of a replacement while it loads and of a survivor in its heal,
at-rest damage between them) whose report must show no violation."""

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


def test_the_catalogue_with_and_without_heal() -> None:
    off = heal_catalogue(False, {})
    assert off == {"heal_kill": {"injectable": False, "how": "not asked for: give --heal"}}
    on = heal_catalogue(True, {"kill_rank": {"injectable": True, "how": "x"},
                               "wipe_ram": {"injectable": False, "how": "no tier 0"}})
    assert on["heal_kill"]["injectable"]
    assert not on["kill_rank"]["injectable"] and "heal_kill" in on["kill_rank"]["how"]
    assert not on["tier1_full"]["injectable"]
    assert all(not on[k]["injectable"] for k in cv.NOTICE_KINDS)
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

SEED = 1164
"""4 cycles on 3 ranks: two ranks killed at once, then a shard byte flipped at rest; a rank
and then its replacement while it loads (the launcher's full restart), then the newest
marker removed at rest; a rank killed once its save is staged, then the newest step removed
at rest; the uploader killed mid-upload and a rank then a survivor in its heal (a full
restart)."""


@pytest.mark.slow
@pytest.mark.timeout(480)  # about 2 minutes on 2 cores
def test_chaos_drill_with_heal_four_cycles_without_a_violation(tmp_path: Path) -> None:
    args = ["drill", "--chaos", "4", "--heal", "--seed", str(SEED), "--kinds",
            "heal_kill,damage,partial_commit,kill_uploader", "--steps", "240", "--out",
            str(tmp_path), "--json", "--", sys.executable, str(EXAMPLE), *SMALL]
    result = CliRunner().invoke(load_commands(), args, catch_exceptions=False)
    doc = json.loads((tmp_path / "chaos-report.json").read_text())
    assert result.exit_code == 0, json.dumps(doc["violations"] or doc["error"], indent=1)
    assert doc["ok"] and doc["config"]["heal"] and doc["config"]["world_size"] == 3
    heals = [f for c in doc["cycles"] for f in c["faults"] if f["kind"] == "heal_kill"]
    assert [(f["variant"], f["landed"]) for f in heals] == [
        ("two_at_once", "heal"), ("replacement", "restart"), ("mid_save", "heal"),
        ("mid_heal", "restart")]
    assert len(heals[0]["ranks"]) == 2 and len(heals[3]["ranks"]) == 2
    assert all(f["R_s"] > 0 and f["restored_step"] is not None for f in heals)
    assert all(f["heal_s"] > 0 for f in heals if f["landed"] == "heal")
    for cyc in doc["cycles"]:
        assert cyc["violations"] == [] and {"heal", "losses", "crash_loop"} <= set(
            cyc["verdicts"])
        if any(f.get("implied") for f in cyc["faults"]):  # the node went down for at-rest
            assert cyc["resumed"] and {"resume", "integrity", "retained"} <= set(
                cyc["verdicts"])
    assert doc["totals"]["faults_by_kind"]["heal_kill"] == 4
    assert (tmp_path / "chaos-report.md").read_text() == render_chaos_markdown(doc)
    assert "heal_kill(two_at_once)@node0 → heal" in render_chaos_markdown(doc)
    assert cf.processes(str(tmp_path / "runs" / "chaos" / "node")) == []
