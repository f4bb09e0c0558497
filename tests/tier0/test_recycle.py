"""Tier 0 rewrites the RAM of a dropped step instead of freeing and refilling it: the file
moves, the next save overwrites it in place, and nothing shared or committed is touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt import Tier0
from tierckpt.format import layout
from tierckpt.tier0 import recycle
from tierckpt.tier0.root import FREE_DIR
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.directio import DirectFile


def _commit(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """A committed-looking step directory (the catalog only needs its name and marker)."""
    d = root / layout.step_dirname(step)
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


def test_retire_keeps_only_shard_files_and_replaces_the_previous_set(tmp_path: Path) -> None:
    free = tmp_path / FREE_DIR
    free.mkdir()
    (free / "__0_0.distcp").write_bytes(b"older set")
    _commit(tmp_path, 3, {"__0_0.distcp": b"a" * 100, "__1_0.distcp": b"b" * 50,
                          "manifest.json": b"{}", "__0.records": b"r"})
    recycle.retire(Tier1Catalog(tmp_path), 3, free)
    assert not (tmp_path / layout.step_dirname(3)).exists()
    assert sorted(os.listdir(free)) == ["__0_0.distcp", "__1_0.distcp"]
    assert (free / "__0_0.distcp").read_bytes() == b"a" * 100  # the older set is gone
    assert not [n for n in os.listdir(tmp_path) if layout.is_deleting_dirname(n)]


def test_a_file_shared_by_a_hard_link_is_never_kept_for_rewriting(tmp_path: Path) -> None:
    free = tmp_path / FREE_DIR
    free.mkdir()
    d = _commit(tmp_path, 1, {"__0_0.distcp": b"committed bytes"})
    os.link(d / "__0_0.distcp", tmp_path / "elsewhere.distcp")  # e.g. a copy by hard link
    recycle.retire(Tier1Catalog(tmp_path), 1, free)
    assert os.listdir(free) == []
    (free / "__0_1.distcp").write_bytes(b"x")
    os.link(free / "__0_1.distcp", tmp_path / "other")
    assert not recycle.take(free, "__0_1.distcp", tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "other").read_bytes() == b"x"
    assert (tmp_path / "elsewhere.distcp").read_bytes() == b"committed bytes"


def test_take_moves_a_free_file_and_reports_none(tmp_path: Path) -> None:
    free = tmp_path / FREE_DIR
    free.mkdir()
    (free / "__2_0.distcp").write_bytes(b"pages")
    assert recycle.take(free, "__2_0.distcp", tmp_path / "dest")
    assert (tmp_path / "dest").read_bytes() == b"pages" and os.listdir(free) == []
    assert not recycle.take(free, "__2_0.distcp", tmp_path / "dest2")
    assert not recycle.take(tmp_path / "missing", "__2_0.distcp", tmp_path / "dest3")


def test_reserve_allocates_what_is_missing_and_stops_on_a_full_tmpfs(tmp_path: Path) -> None:
    free = tmp_path / FREE_DIR
    free.mkdir()
    (free / "__0_0.distcp").write_bytes(b"kept")
    got = recycle.reserve(free, {"__0_0.distcp": 10, "__0_1.distcp": 4096}, file_mode=0o640)
    assert got == 4096
    assert (free / "__0_0.distcp").read_bytes() == b"kept"
    assert os.stat(free / "__0_1.distcp").st_size == 4096
    assert os.stat(free / "__0_1.distcp").st_blocks * 512 >= 4096  # allocated, not sparse
    huge = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize + (1 << 30)
    assert recycle.reserve(free, {"__0_2.distcp": huge}, file_mode=0o640) == 0
    assert not (free / "__0_2.distcp").exists()  # nothing half-allocated is left


def test_a_rewritten_file_holds_exactly_the_new_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\xff" * 10_000)
    f = DirectFile(path, direct=False, fsync=False, reuse=True)
    f.write(b"new" * 100)
    f.close()
    assert path.read_bytes() == b"new" * 100
    assert f.size == 300
    with pytest.raises(FileNotFoundError):
        DirectFile(tmp_path / "absent", direct=False, reuse=True)


def _inodes(step_dir: Path) -> dict[str, int]:
    return {n: os.stat(step_dir / n).st_ino for n in os.listdir(step_dir)
            if layout.shard_rank(n) is not None}


def test_saves_into_ram_rewrite_the_dropped_steps_files(tmp_path: Path, shm: Path) -> None:
    """keep=1: save 1 allocates (and reserves a second set), save 2 takes the reserve,
    save 3 rewrites save 1's files, save 4 save 2's; every step restores its own values."""
    model = nn.Linear(256, 256)
    ts = tierckpt.TrainState(model=model)
    t0 = Tier0(shm / "t0", tier1_every=100, keep=1, keep_on_close=True)
    seen: dict[int, dict[str, int]] = {}
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=t0) as ck:
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                model.weight.fill_(float(step))
            ck.save(step, ts).wait(30)
            seen[step] = _inodes(shm / "t0" / layout.step_dirname(step))
            assert Tier1Catalog(shm / "t0").complete_steps() == [step]
        assert os.listdir(shm / "t0" / FREE_DIR)  # the next save's pages
    assert os.listdir(shm / "t0" / FREE_DIR) == []  # given back at a clean close
    assert seen[3] == seen[1] and seen[4] == seen[2] and seen[1] != seen[2]
    with torch.no_grad():
        model.weight.zero_()
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=t0) as ck:
        info = ck.restore(ts)
    assert (info.step, info.source) == (4, "tier0")
    assert torch.equal(model.weight, torch.full((256, 256), 4.0))


def test_a_smaller_state_after_a_larger_one_restores_exactly(tmp_path: Path, shm: Path) -> None:
    """A rewritten file is cut to its new length: no bytes of the larger save remain."""
    t0 = Tier0(shm / "t0", tier1_every=100, keep=1, keep_on_close=True)
    big = tierckpt.TrainState(model=nn.Linear(512, 512))
    small_model = nn.Linear(8, 8)
    small = tierckpt.TrainState(model=small_model)
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=t0) as ck:
        for step in (1, 2):
            ck.save(step, big).wait(30)
        ck.save(3, small).wait(30)
        ck.save(4, small).wait(30)
    expect = {k: v.clone() for k, v in small_model.state_dict().items()}
    with torch.no_grad():
        for p in small_model.parameters():
            p.zero_()
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=t0) as ck:
        info = ck.restore(small)
    assert (info.step, info.source) == (4, "tier0")
    for k, v in small_model.state_dict().items():
        assert torch.equal(v, expect[k]), k
