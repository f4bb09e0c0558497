"""The heal drill end to end on examples/train.py, through `tierckpt drill --heal`: a rank
killed mid-step heals, a replacement killed while it loads falls back to a full restart,
the losses stay the reference's bit for bit; and its configuration errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierckpt.cli._app import load_commands
from tierckpt.drill.heal import HealDrillConfig
from tierckpt.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
COMMAND = (sys.executable, str(ROOT / "examples" / "train.py"), "--save-every", "5",
           "--layers", "1", "--dim", "32", "--samples", "512", "--timeout", "60")


@pytest.mark.slow
def test_heal_drill_passes_on_the_reference_user(tmp_path: Path) -> None:
    res = CliRunner().invoke(load_commands(), [
        "drill", "--heal", "--nproc", "3", "--steps", "45", "--seed", "1",
        "--kinds", "mid_step,replacement,mid_heal", "--out", str(tmp_path), "--", *COMMAND])
    doc = json.loads((tmp_path / "heal-report.json").read_text())
    assert res.exit_code == 0 and doc["ok"], (res.output, json.dumps(doc, indent=1))
    assert f"report: {tmp_path / 'heal-report.md'}" in " ".join(res.output.split())
    kinds = [(f["kind"], f["outcome"]) for f in doc["faults"]]
    assert kinds == [("mid_step", "heal"), ("replacement", "restart"),
                     ("mid_heal", "restart")]
    healed = doc["faults"][0]
    assert healed["R_s"] > 0 and healed["heal_s"] > 0 and healed["restored_step"] >= 4
    md = (tmp_path / "heal-report.md").read_text()
    assert "| continuity | yes |" in md and "| mid_step |" in md


@pytest.mark.parametrize("kw, match", [
    ({"faults": ("nap",)}, "heal faults"), ({"faults": ()}, "heal faults"),
    ({"nproc": 2}, "nproc >= 3"), ({"steps": 20}, "too few"), ({"command": ()}, "after --"),
])
def test_bad_configuration_says_what_to_fix(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HealDrillConfig(**{"command": COMMAND, **kw})
