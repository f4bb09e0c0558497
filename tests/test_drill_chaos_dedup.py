"""``tierckpt drill --chaos 3 --dedup``: the chaos drill with the faults of tier 2's content
objects on examples/train.py (2 simulated nodes, real torchrun, real SIGKILLs, a file://
tier 2), each paired with a wiped node that can restore only from tier 2. Seed 16 draws: a
deletion of the oldest tier-2 step SIGKILLed mid-way; a shard object of the newest tier-2
step removed, then one flipped, each a shard of the wiped node (it must restore an older
step: the library skips the step whose fetch finds its shard missing or damaged). The
report must show no violation, every tier-2 step verifying but the damaged ones, and the
final step verified on tier 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_drill_chaos import EXAMPLE, SMALL
from tierckpt.cli._app import load_commands
from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_verdicts as cv

SEED = 16
"""wipe_node + cut_deletion; wipe_node + damage_object(missing); wipe_node +
damage_object(flip) (over --kinds damage_object,cut_deletion,wipe_node,partial_commit)."""


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 2 min on 2 cores
def test_chaos_drill_with_object_faults_without_a_violation(tmp_path: Path) -> None:
    # --step-sleep: tier 2 gains a step per uploader poll (2 s); each cycle waits for two
    args = ["drill", "--chaos", "3", "--seed", str(SEED), "--dedup", "--kinds",
            "damage_object,cut_deletion,wipe_node,partial_commit", "--steps", "450",
            "--out", str(tmp_path), "--json", "--", sys.executable, str(EXAMPLE), *SMALL,
            "--step-sleep", "0.04"]
    result = CliRunner().invoke(load_commands(), args, catch_exceptions=False)
    doc = json.loads((tmp_path / "chaos-report.json").read_text())
    assert result.exit_code == 0, json.dumps(doc["violations"] or doc["error"], indent=1)
    assert doc["ok"] and doc["violations"] == [] and doc["config"]["dedup"] is True
    assert all(doc["catalogue"][k]["injectable"] for k in cv.OBJECT_KINDS)
    fired = [f for c in doc["cycles"] for f in c["faults"] if f["fired"]]
    assert {f["kind"] for f in fired} >= cv.OBJECT_KINDS | {"wipe_node"}
    assert any("SIGKILLed before deletion" in f["detail"] for f in fired
               if f["kind"] == "cut_deletion")
    assert {f["variant"] for f in fired if f["kind"] == "damage_object"} == {"flip", "missing"}
    fell_back = [(c["resumed"][0]["step"], int(f["detail"].rsplit(" ", 1)[1].rstrip(")")))
                 for c in doc["cycles"] for f in c["faults"] if f["kind"] == "damage_object"]
    assert fell_back and all(got < damaged for got, damaged in fell_back), fell_back
    verdicts = [c["verdicts"]["tier2"] for c in (*doc["cycles"], doc["final"])]
    assert all(v["ok"] for v in verdicts)
    assert any("fail as they must" in v["detail"] for v in verdicts)  # damage found
    assert "; 0 orphan object(s)" in verdicts[-1]["detail"]  # the cut's leftovers swept
    assert doc["final"]["verdicts"]["final"]["ok"]
    assert cf.processes(str(tmp_path / "runs" / "chaos" / "node")) == []
