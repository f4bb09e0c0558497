"""The node-loss heal drill (``tierckpt drill --heal --nnodes N``) end to end on
examples/train.py through the CLI, with the private etcd the drill starts: a lost node (its
processes, tier-1 disk and RAM) is healed by a spare node, a node lost when no spare node is
left restarts the job, and the losses stay the reference's bit for bit; and its
configuration errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests._require import require
from tierckpt.cli._app import load_commands
from tierckpt.drill.heal_nodes import NodeDrillConfig
from tierckpt.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
COMMAND = (sys.executable, str(ROOT / "examples" / "train.py"), "--save-every", "5",
           "--layers", "1", "--dim", "32", "--samples", "512", "--timeout", "60",
           "--parallel", "ddp", "--step-sleep", "0.1")


@pytest.mark.slow
def test_node_drill_heals_lost_nodes_and_restarts_without_a_spare(tmp_path: Path) -> None:
    require(shutil.which("etcd") is not None, "etcd is missing (apt-get install etcd-server)")
    # store_node is left out here: under the suite's load (3 lanes on 2 cores) the etcd
    # election it causes can stall a live node's heartbeat past the 1 s suspicion window,
    # and the heal becomes a full restart (a known weakness, stop 50's note); it is drilled
    # by hand (docs/drills.md)
    res = CliRunner().invoke(load_commands(), [
        "drill", "--heal", "--nnodes", "2", "--steps", "60", "--seed", "3",
        "--kinds", "node_lost,spare_lost,no_spare", "--out", str(tmp_path), "--",
        *COMMAND])
    doc = json.loads((tmp_path / "heal-nodes-report.json").read_text())
    assert res.exit_code == 0 and doc["ok"], _why(tmp_path, doc)
    assert [(f["kind"], f["outcome"]) for f in doc["faults"]] == [
        ("node_lost", "heal"), ("spare_lost", "restart"), ("no_spare", "restart")]
    # docs/drills.md: the faults fall at S/(F+2), 2S/(F+2), ... each a seeded few steps later
    span = 60 // (3 + 2)
    assert [f["at_step"] // span for f in doc["faults"]] == [1, 2, 3], doc["faults"]
    spare = doc["faults"][1]  # the running node, then the spare node that took its slot
    assert len(spare["nodes"]) == 2 and spare["nodes"][1].startswith("spare"), spare
    lost = doc["faults"][0]
    assert lost["R_s"] > 0 and lost["restored_step"] >= 0 and len(lost["nodes"]) == 1
    assert not (tmp_path / "nodes-run" / lost["nodes"][0] / "t1").exists()  # its disk went
    md = (tmp_path / "heal-nodes-report.md").read_text()
    assert "| continuity | yes |" in md and "| node_lost |" in md
    assert "report: " in res.output


def _why(out: Path, doc: dict[str, Any]) -> str:
    """What failed, short: the faults' errors, the failed verdicts and each node log's end
    (the CLI's table is cut by pytest's repr; these are what tell a cause)."""
    lines = [json.dumps(f) for f in doc["faults"]]
    lines += [f"{k}: {v['detail']}" for k, v in doc["verdicts"].items() if not v["ok"]]
    for log in sorted((out / "nodes-run").glob("*.log")):
        lines += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-15:]]
    return "\n".join(lines)


@pytest.mark.parametrize(("kw", "match"), [
    ({"faults": ("nap",)}, "node faults"), ({"faults": ()}, "node faults"),
    ({"nnodes": 1}, "--nnodes >= 2"), ({"nproc": 0}, "--nproc >= 1"),
    ({"faults": ("two_nodes",), "nnodes": 2}, "two_nodes needs --nnodes >= 3"),
    ({"faults": ("no_spare", "node_lost")}, "no_spare must come after every heal"),
    ({"faults": ("no_spare", "spare_lost")}, "no_spare must come after every heal fault and"),
    ({"faults": ("spare_lost", "node_lost")}, "spare_lost must come after every heal"),
    ({"etcd": "http://h:1"}, "--etcd 'http://h:1'"), ({"steps": 30}, "too few"),
    ({"etcd": "etcd://h:1", "faults": ("store_node",)}, "leave out --etcd"),
    ({"command": ()}, "after --"),
])
def test_bad_configuration_says_what_to_fix(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        NodeDrillConfig(**{"command": COMMAND, "steps": 80, "nnodes": 3, **kw})


def test_spare_nodes_are_the_nodes_the_heals_lose() -> None:
    assert NodeDrillConfig(command=COMMAND, nnodes=3, steps=90).spares == 5  # 1+2+1, +1
    assert NodeDrillConfig(command=COMMAND, faults=("no_spare",)).spares == 0
