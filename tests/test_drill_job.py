"""DrillJob: the fields the resume, preemption and chaos drills share, checked once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierckpt.drill.chaos_config import ChaosConfig
from tierckpt.drill.drills import DrillConfig
from tierckpt.drill.job import DrillJob, check_steps
from tierckpt.drill.preempt import PreemptConfig
from tierckpt.errors import ConfigError


def test_defaults_resolve_out_and_tier2(tmp_path: Path) -> None:
    job = DrillJob(command=["python", "t.py"], out=tmp_path / "x")  # type: ignore[arg-type]
    assert job.command == ("python", "t.py") and job.out.is_absolute()
    assert job.tier2 == f"file://{tmp_path / 'x' / 'tier2'}" and job.world_size == 2
    assert DrillJob(command=("p",), out=Path("rel")).out == Path("rel").absolute()
    assert job.roots("r") == (tmp_path / "x" / "runs" / "r" / "tier1",)
    assert job.roots("r", nnodes=2)[1] == tmp_path / "x" / "runs" / "r" / "node1"


@pytest.mark.parametrize("bad, match", [
    ({"command": ()}, "training command"),
    ({"nproc": 0}, "--nproc must be an int >= 1"),
    ({"nnodes": True}, "--nnodes must be an int >= 1"),
    ({"rtol": -1.0}, "--rtol"),
    ({"rtol": float("nan")}, "--rtol"),
    ({"tier2": "s3://b:9000/p"}, "--tier2"),
])
def test_bad_fields_name_the_flag(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DrillJob(**{"command": ("python", "t.py"), **bad})


@pytest.mark.parametrize("cls, kw, usage", [
    (DrillConfig, {}, "tierckpt drill -- "),
    (PreemptConfig, {}, "tierckpt drill --preempt -- "),
    (ChaosConfig, {"cycles": 1}, "tierckpt drill --chaos 10 -- "),
])
def test_every_drill_config_checks_the_job_and_names_its_own_usage(
        cls: type[DrillJob], kw: dict[str, Any], usage: str) -> None:
    with pytest.raises(ConfigError, match=f"e.g. {usage}"):
        cls(command=(), **kw)
    with pytest.raises(ConfigError, match="--nproc must be an int >= 1"):
        cls(command=("p",), nproc=0, **kw)
    with pytest.raises(ConfigError, match="--rtol"):
        cls(command=("p",), rtol=-1.0, **kw)


def test_check_steps_wants_room_for_six() -> None:
    check_steps(6)
    for bad in (5, True, 6.0):
        with pytest.raises(ConfigError, match=r"--steps must be an int >= 6 \(why\), got"):
            check_steps(bad, " (why)")
