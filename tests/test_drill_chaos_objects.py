"""The chaos drill's hands on tier 2's content objects, on a real file:// tier 2 that a
real job uploaded to: a flipped or removed object is found by a full check of the steps that
need it and no other; a deletion SIGKILLed before each of its deletions in turn (a real
process, a real SIGKILL) never leaves a complete step that does not verify, and what it
leaves behind goes with the next sweep and lease expiry."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt.drill import chaos_objects as co
from tierckpt.format import layout
from tierckpt.ops.check import check_tier2
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage

pytestmark = pytest.mark.slow  # real uploads: the uploader polls every 2 s


def _uploaded(tmp_path: Path, steps: int = 3) -> Path:
    """A file:// tier 2 holding ``steps`` complete steps of a small model (each on tier 2
    before the next is saved); returns its directory."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    st = tierckpt.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1",
                                    tier2=tierckpt.Tier2(bucket.as_uri())) as ck:
        for step in range(steps):
            with torch.no_grad():
                m.weight.add_(1.0)
            ck.save(step, st).wait()
            deadline = time.monotonic() + 60
            while not (bucket / layout.step_dirname(step) / layout.COMPLETE).is_file():
                assert time.monotonic() < deadline, f"step {step} never reached tier 2"
                time.sleep(0.05)
    return bucket


def _verifies(bucket: Path) -> dict[int, bool]:
    with LocalStorage(bucket) as storage:
        return {s: check_tier2(storage, s, scratch=bucket.parent).ok
                for s in Tier2Catalog(storage).complete_steps()}


def test_a_damaged_or_missing_object_fails_the_steps_that_need_it_only(tmp_path: Path) -> None:
    bucket = _uploaded(tmp_path)
    maps = co.tier2_maps(bucket)
    assert sorted(maps) == [0, 1, 2] and all(maps.values())
    shared = set(maps[0].values()) & set(maps[1].values())  # .metadata: the same bytes
    unique = co.unique_objects(maps, 2)
    assert unique and unique[0][0].endswith(".distcp")  # shards first
    assert not {k for _, k in unique} & shared
    detail = co.damage_object(bucket, unique[0][1], "flip", 0.5)
    assert "flipped byte" in detail and "tier 2's objects/sha256/" in detail
    assert _verifies(bucket) == {0: True, 1: True, 2: False}
    co.damage_object(bucket, co.unique_objects(maps, 1)[0][1], "missing", 0.0)
    assert _verifies(bucket) == {0: True, 1: False, 2: False}
    assert co.leftovers(bucket) == (0, 0)


def test_a_deletion_killed_before_each_of_its_deletions_leaves_every_complete_step_whole(
        tmp_path: Path) -> None:
    """Deleting step 0 (its marker, its map and manifest, a lease, what only step 0 had, the
    lease again) with a real SIGKILL before deletion 1, 2, …: steps 1 and 2 always verify,
    step 0 is complete and whole or gone; a sweep then leaves no orphan, and a waiting
    uploader removes the lease the kill left once it expired."""
    (tmp_path / "pristine").mkdir()
    pristine = _uploaded(tmp_path / "pristine")
    points = 3 + len(co.unique_objects(co.tier2_maps(pristine), 0)) + 1
    outcomes = []
    for kill_at in range(1, points + 2):
        bucket = tmp_path / f"cut{kill_at}"
        shutil.copytree(pristine, bucket)  # keeps the stored CRC32C (an xattr)
        detail = co.cut_deletion(bucket, 0, kill_at)
        outcomes.append("SIGKILLed" in detail)
        ok = _verifies(bucket)
        assert ok[1] and ok[2] and ok.get(0, True), (kill_at, detail, ok)
        assert (0 in ok) == (kill_at == 1), (kill_at, detail)  # the marker goes first
        with LocalStorage(bucket) as storage:
            catalog = Tier2Catalog(storage, sweep_window_s=0.05)  # a quick uploader
            catalog.sweep()
            assert co.leftovers(bucket)[0] == 0, (kill_at, detail)
            catalog.await_sweeps()  # a lease the killed sweep left expires and goes
        assert co.leftovers(bucket) == (0, 0)
    assert outcomes == [True] * points + [False]  # killed at every point; then it finished
