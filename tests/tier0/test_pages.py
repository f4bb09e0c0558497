"""Tier 0 keeps its shard files mapped: a rewrite copies into the mapping and leaves exactly
the bytes (and CRC32C) a write would; mappings follow inodes and go with deleted files."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import tierckpt
from tierckpt import Tier0
from tierckpt.format import checksum, layout
from tierckpt.runtime import events
from tierckpt.tier0.pages import KeptMappings
from tierckpt.tier1.directio import DirectFile

MiB = 1 << 20


def _aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned memory (what staging gives the writer: zero-copy writes)."""
    m = mmap.mmap(-1, len(data))
    m[:] = data
    return memoryview(m)


def _write(path: Path, parts: list[bytes], mapping: mmap.mmap | None,
           reuse: bool = True) -> DirectFile:
    f = DirectFile(path, direct=False, fsync=False, zero_copy=True, reuse=reuse,
                   io_threads=2, mapping=mapping)
    for part in parts:
        f.write(_aligned(part) if len(part) >= MiB else part)
    f.mark()
    f.close()
    return f


def _parts(seed: int, big: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    blob = torch.randint(0, 256, (big + 300,), dtype=torch.uint8, generator=g).numpy().tobytes()
    return [blob[:100], blob[100:100 + big], blob[100 + big:]]  # header, tensor, trailer


def test_a_mapped_rewrite_holds_exactly_the_written_bytes(tmp_path: Path) -> None:
    # the same writes, into a fresh file and into a mapped recycled one: same bytes, same
    # CRC32C; a new length cuts or grows the file (past the mapping: written, not copied)
    kept = KeptMappings()
    try:
        for big, old_size in ((3 * MiB, 8 * MiB), (5 * MiB, 2 * MiB + 12345)):
            parts = _parts(big, big)
            plain = tmp_path / f"plain-{big}"
            want = _write(plain, parts, None, reuse=False)
            path = tmp_path / f"kept-{big}"
            path.write_bytes(b"\xee" * old_size)
            assert kept.adopt([path]) == old_size
            got = _write(path, parts, kept.lookup(path))
            assert path.read_bytes() == plain.read_bytes() == b"".join(parts)
            assert got.crc == want.crc == checksum.extend(0, b"".join(parts))
            assert got.mapped_bytes > 0 and got.size == want.size
            assert got.mapped_bytes <= old_size < got.size or got.size < old_size
    finally:
        kept.close()


def test_without_a_mapping_a_rewrite_writes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\xee" * (4 * MiB))
    f = _write(path, _parts(1, 3 * MiB), None)
    assert f.mapped_bytes == 0 and path.stat().st_size == 3 * MiB + 300


def test_a_hole_is_written_not_copied_into(shm: Path) -> None:
    # a file cut and regrown after it was mapped owns no pages past the cut: a copy there
    # would allocate (a full tmpfs answers a store with SIGBUS), so from the hole on the
    # bytes are written
    path = shm / "sparse"
    path.write_bytes(b"\xee" * (8 * MiB))
    kept = KeptMappings()
    try:
        kept.adopt([path])
        os.truncate(path, MiB)
        os.truncate(path, 8 * MiB)
        parts = _parts(2, 4 * MiB)
        got = _write(path, parts, kept.lookup(path))
        assert path.read_bytes() == b"".join(parts)
        assert 0 < got.mapped_bytes <= MiB
    finally:
        kept.close()


def test_mappings_follow_the_inode_and_go_with_deleted_files(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * MiB)
    kept = KeptMappings()
    try:
        assert kept.adopt([a, tmp_path / "absent"]) == MiB
        assert kept.adopt([a]) == 0  # mapped already: nothing to do
        moved = tmp_path / "free-a"
        os.rename(a, moved)  # retire/take move files: the mapping follows the inode
        a.write_bytes(b"y" * MiB)  # a new file under the old name is not that file
        assert kept.lookup(moved) is not None and kept.lookup(a) is None
        assert kept.lookup(b) is None
        assert kept.prune() == 0 and kept.nbytes == MiB
        os.unlink(moved)
        assert kept.prune() == 1 and kept.nbytes == 0 and kept.lookup(a) is None
    finally:
        kept.close()


def test_a_forked_child_does_not_inherit_the_mappings(tmp_path: Path) -> None:
    # a data loader's worker forked after the mapping must not pin the file's pages
    path = tmp_path / "kept-file"
    path.write_bytes(b"x" * MiB)
    kept = KeptMappings()
    try:
        kept.adopt([path])
        assert str(path) in Path("/proc/self/maps").read_text()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report whether it maps the file, and leave at once
            os.write(w, b"1" if str(path) in Path("/proc/self/maps").read_text() else b"0")
            os._exit(0)
        os.close(w)
        seen = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert seen == b"0"
    finally:
        kept.close()
    assert str(path) not in Path("/proc/self/maps").read_text()


def test_saves_into_ram_copy_into_kept_mappings(tmp_path: Path, shm: Path) -> None:
    """keep=1: save 1 writes fresh files, and they (and the reserved set) are mapped after
    it; saves 2-4 copy into mappings; the newest restores exactly from RAM, and its tier-1
    copy made at close is read by plain ``dcp.load``."""
    model = nn.Linear(512, 512)
    ts = tierckpt.TrainState(model=model)
    t0 = Tier0(shm / "t0", tier1_every=100, keep=1, keep_on_close=True)
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=t0) as ck:
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                model.weight.fill_(float(step))
            ck.save(step, ts).wait(30)
    with torch.no_grad():
        model.weight.zero_()
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=t0) as ck:
        info = ck.restore(ts)
    assert (info.step, info.source) == (4, "tier0")
    assert torch.equal(model.weight, torch.full((512, 512), 4.0))
    log = events.read_events(tmp_path / "t1" / layout.EVENTS)
    mapped = {e["step"]: e["mapped"] for e in log
              if e["event"] == events.SAVE_DURABLE and e.get("tier") == "tier0"}
    weight = 512 * 512 * 4
    assert mapped[1] == 0 and all(mapped[s] >= weight for s in (2, 3, 4)), mapped
    out = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(out, checkpoint_id=str(tmp_path / "t1" / layout.step_dirname(4)), no_dist=True)
    assert torch.equal(out["model"]["weight"], torch.full((512, 512), 4.0))
