"""Resume from tier 2 alone at any step it retains, after its retention and a deletion have
swept the content objects, on SeaweedFS and moto (issue 41's target): a LoRA fine-tune with
incremental saves uploads each step (its frozen base once), tier 2 keeps the newest two; the
tier-1 disk is lost; the job resumes from the newest, then, that one deleted, from the one
before, and trains on bit for bit as the run that never stopped."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from s3server import S3Env

import tierckpt
from tests.save.test_incremental import _state, _train
from tierckpt import Tier2, Writes
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2 import probe
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

pytestmark = pytest.mark.slow


def _on_tier2(root: Path, step: int, timeout_s: float = 120.0) -> None:
    """Wait until the uploader verified ``step`` on tier 2."""
    deadline = time.monotonic() + timeout_s
    while (r := Tier1Catalog(root).uploads.upload_record(step)) is None or \
            r.get("status") != "verified":
        assert time.monotonic() < deadline, f"step {step} not on tier 2: {r}"
        time.sleep(0.05)


def _continues(url: str, root: Path, step: int) -> None:
    """A fresh node (empty tier 1) resumes at ``step`` and trains on as the reference."""
    st = _state(seed=7)
    with tierckpt.CheckpointManager(tier1=root, tier2=Tier2(url)) as ck:
        info = ck.restore(st)
    assert info is not None and info.step == step and info.source == "tier2", info
    ref = _state(seed=0)
    _train(ref, range(step + 1))
    assert _train(st, range(step + 1, step + 4)) == _train(ref, range(step + 1, step + 4))


def test_resume_from_tier2_alone_at_each_retained_step_after_deletions(
        tmp_path: Path, any_s3_env: S3Env) -> None:
    url, root = any_s3_env.url, tmp_path / "t1"
    st = _state(seed=0)
    with tierckpt.CheckpointManager(tier1=root, tier2=Tier2(url, keep_last=2),
                                    writes=Writes(incremental=True)) as ck:
        for step in range(6):
            _train(st, range(step, step + 1))
            ck.save(step, st).wait()
            _on_tier2(root, step)  # each on tier 2 before the next: retention runs on it
    with open_storage(url, **probe.probe_url(url).store_options()) as storage:
        remote = Tier2Catalog(storage)
        assert remote.complete_steps() == [4, 5]  # 0-3 deleted, their objects swept
        _continues(url, tmp_path / "fresh5", 5)
        remote.delete(5)  # what 4 shares with 5 stays; what only 5 had goes
        assert remote.complete_steps() == [4]
    _continues(url, tmp_path / "fresh4", 4)
