"""The README's loops, each run twice as printed: the first run ends with its last step
saved (a clean end keeps its work), the second restores it and trains no more; with tier 2,
the final step is on tier 2 when the first run returns."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.journeys import _run
from tests.s3server import S3Env

pytestmark = pytest.mark.slow


@pytest.fixture
def shm_base() -> Iterator[Path]:
    base = Path("/dev/shm") / f"tierckpt-journey-{uuid.uuid4().hex[:8]}"
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_the_smallest_loop_restores_step_99(tmp_path: Path) -> None:
    code, ckpt = _run.block("README.md", 0).code, tmp_path / "ckpt"
    _run.ok(_run.run(code, tmp_path, _run.env()), "run 1")
    assert _run.tier1_steps(ckpt)[0] == 99
    saves = len(_run.events(ckpt, "save_committed"))
    _run.ok(_run.run(code, tmp_path, _run.env()), "run 2")
    assert _run.restored_steps(ckpt) == [99]  # "the second run restores step 99"
    assert len(_run.events(ckpt, "save_committed")) == saves  # "and trains no more"


def test_the_tiered_loop_keeps_its_work_and_copies_it_to_tier_2(
        tmp_path: Path, s3_env: S3Env, shm_base: Path) -> None:
    block = _run.block("README.md", 1)
    assert "s3://bucket/run-7" in block.code and "AutoInterval" in block.code
    code, ckpt = block.code.replace("s3://bucket/run-7", s3_env.url), tmp_path / "ckpt"
    env = _run.env({**s3_env.env, "TIERCKPT_TIER0_BASE": str(shm_base)})
    first = _run.run(code, tmp_path, env)
    _run.ok(first, "run 1")
    # the interval chose a save far past step 99: the clean end saved the last step itself
    assert [e["step"] for e in _run.events(ckpt, "final_save")] == [99]
    assert _run.tier2_steps(s3_env.url)[0] == 99  # on tier 2 before close() returned
    _run.ok(_run.run(code, tmp_path, env), "run 2")
    assert _run.restored_steps(ckpt) == [99]
