"""ShardWriter: per-record CRC32Cs (manifest chunks) match the bytes of each DCP item and
tile the file, and the file CRC is unchanged by computing them on the same pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt.format import checksum
from tierckpt.save.writer import ShardWriter
from tierckpt.tier1.directio import DirectFile


def test_directfile_marks_give_record_crcs_and_the_file_crc(tmp_path: Path) -> None:
    parts = [b"a" * 5, bytes(range(256)) * 300, b"", b"xyz" * 7000]
    f = DirectFile(tmp_path / "f", direct=False)
    marks = []
    for p in parts:
        f.write(p)
        marks.append(f.mark())
    f.close()
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(parts)
    offsets = [sum(map(len, parts[:i])) for i in range(len(parts))]
    assert marks == [(o, len(p), checksum.extend(0, p))
                     for o, p in zip(offsets, parts, strict=True)]
    assert f.crc == checksum.extend(0, data)


def test_chunks_cover_every_item_and_verify(tmp_path: Path) -> None:
    sd = {"w": torch.randn(64, 33), "b": torch.arange(10), "blob": {"x": 1}}
    w = ShardWriter(tmp_path, thread_count=2, fsync=False, direct_io=False)
    dcp.save(sd, storage_writer=w, no_dist=True)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    by_file = {f.name: f for f in w.files}
    items = 0
    for index, info in md.storage_data.items():
        entry = by_file[info.relative_path]
        chunk = entry.chunk(info.offset, info.length)
        assert chunk is not None, index
        data = (tmp_path / info.relative_path).read_bytes()
        assert checksum.extend(0, data[info.offset:info.offset + info.length]) == chunk.crc32c
        items += 1
    assert items == len(md.storage_data) >= 3
    for entry in w.files:  # chunks tile the file; the file CRC is the whole file's
        assert sum(c.length for c in entry.chunks) == entry.size
        assert entry.crc32c == checksum.of_file(tmp_path / entry.name)[0]


@pytest.mark.parametrize("io_threads", [1, 3])
def test_large_page_aligned_tensors_are_written_without_a_copy(tmp_path: Path,
                                                              io_threads: int) -> None:
    """O_DIRECT: each large tensor's bytes go straight from the (page-aligned) staging
    buffer, at a page-aligned file offset reached by zero padding before its record; the
    records still load with plain DCP and their CRC32Cs hold — with one write in flight, or
    several at their own offsets (``io_threads``, as tier 0 writes RAM)."""
    from tierckpt.save.staging import HostStager

    stager = HostStager(copy_threads=1)
    src = {"a": torch.randn(1 << 18), "b": torch.randn(3, 1 << 18).half(), "c": torch.randn(7),
           "d": torch.arange((1 << 18) + 3, dtype=torch.int32)}
    staged = stager.stage(src).tree
    stager.close()
    w = ShardWriter(tmp_path, fsync=False, direct_io=True, io_threads=io_threads)
    dcp.save(staged, storage_writer=w, no_dist=True)
    (entry,) = w.files
    large = sum(v.numel() * v.element_size() for k, v in src.items() if k != "c")
    assert large - 3 * 4096 <= w.zero_copied <= large  # each one's sub-page tail is copied
    data = (tmp_path / entry.name).read_bytes()
    assert entry.size == len(data) and entry.crc32c == checksum.extend(0, data)
    pos = 0
    for c in entry.chunks:  # in order; anything between records is padding (zeros)
        assert c.offset >= pos and data[pos:c.offset] == bytes(c.offset - pos)
        assert checksum.extend(0, data[c.offset:c.offset + c.length]) == c.crc32c
        pos = c.offset + c.length
    out = {k: torch.empty_like(v) for k, v in src.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], src[k]) for k in src)


@pytest.mark.parametrize("io_threads", [1, 3])
def test_small_records_cycle_the_small_zero_copy_buffers(tmp_path: Path, io_threads: int) -> None:
    """With zero_copy the I/O buffers are 2 × ZERO_COPY_BUFFER: 6 MiB of sub-MiB records
    after two zero-copy ones fill and reuse them many times; every byte and CRC32C holds."""
    from tierckpt.save.staging import HostStager
    from tierckpt.tier1.directio import ZERO_COPY_BUFFER, ZERO_COPY_MIN

    stager = HostStager(copy_threads=1)
    src = {"big0": torch.randn(3 << 18), "big1": torch.randn(1 << 18)}
    src.update({f"s{i}": torch.randn(50_000 + 777 * i) for i in range(30)})  # ~200 KiB each
    assert all(v.numel() * 4 < ZERO_COPY_MIN for k, v in src.items() if k[0] == "s")
    staged = stager.stage(src).tree
    stager.close()
    w = ShardWriter(tmp_path, fsync=False, direct_io=True, io_threads=io_threads)
    dcp.save(staged, storage_writer=w, no_dist=True)
    (entry,) = w.files
    small = sum(v.numel() * 4 for k, v in src.items() if k[0] == "s")
    assert small > 4 * ZERO_COPY_BUFFER and w.zero_copied >= 4 << 20
    data = (tmp_path / entry.name).read_bytes()
    assert entry.size == len(data) and entry.crc32c == checksum.extend(0, data)
    for c in entry.chunks:
        assert checksum.extend(0, data[c.offset:c.offset + c.length]) == c.crc32c
    out = {k: torch.empty_like(v) for k, v in src.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], src[k]) for k in src)


def test_rank_records_take_the_chunks_out_of_the_file_list(tmp_path: Path) -> None:
    """After ``write_rank_records`` the file list (what the manifest lists) names each shard
    file with its size and CRC32C only; ``__<rank>.records`` holds every record's CRC32C."""
    from tierckpt.format import layout, records
    from tierckpt.format import manifest as mf

    sd = {"w": torch.randn(64, 33), "b": torch.arange(10), "blob": {"x": 1}}
    w = ShardWriter(tmp_path, thread_count=2, fsync=False, direct_io=False)
    dcp.save(sd, storage_writer=w, no_dist=True)
    before = {f.name: f.chunks for f in w.files}
    rec = w.write_rank_records()
    assert rec.name == layout.rank_records_filename(0) and rec.rank == 0
    assert rec.chunks == ()  # read whole, checked whole
    assert rec.crc32c == checksum.of_file(tmp_path / rec.name)[0]
    shards = [f for f in w.files if f.name != rec.name]
    assert {f.name for f in shards} == set(before) and all(not f.chunks for f in shards)
    m = mf.Manifest(step=1, world_size=1, save_id="x", files=tuple(w.files))
    back = records.parse((tmp_path / rec.name).read_bytes(), m, rank=0, source=rec.name)
    assert back == before
