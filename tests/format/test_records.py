"""``format/records.py``: the per-record CRC32Cs of each rank's shard files live in its own
``__<rank>.records``; the manifest lists files only. Round trip, refusals, and the lazy,
checked load of :class:`ChunkIndex` (inline chunks of older manifests still win)."""

from __future__ import annotations

import json

import pytest

from tierckpt.errors import IntegrityError
from tierckpt.format import checksum, layout, records
from tierckpt.format import manifest as mf

CHUNKS = {0: (mf.Chunk(0, 4, 0xA), mf.Chunk(4, 6, 0xB)), 1: (mf.Chunk(0, 7, 0xC),)}


def _files(inline: bool = False) -> list[mf.FileEntry]:
    return [mf.FileEntry(name=layout.shard_filename(r, 0), size=10 if r == 0 else 7,
                         crc32c=r, rank=r, chunks=CHUNKS[r] if inline else ())
            for r in (0, 1)]


def _manifest(rec: dict[int, bytes], inline: bool = False) -> mf.Manifest:
    extra = [mf.FileEntry(name=layout.rank_records_filename(r), size=len(b),
                          crc32c=checksum.extend(0, b), rank=r) for r, b in rec.items()]
    return mf.Manifest(step=5, world_size=2, save_id="s", domains=((0, 1),),
                       files=(*_files(inline), *extra))


def _rec(rank: int) -> bytes:
    return records.to_bytes(rank, [f for f in _files(inline=True) if f.rank == rank])


def test_round_trip_through_the_index_reads_each_rank_once() -> None:
    data = {0: _rec(0), 1: _rec(1)}
    reads: list[str] = []

    def read(name: str) -> bytes:
        reads.append(name)
        return data[int(name[2:].split(".")[0])]
    index = records.ChunkIndex(_manifest(data), read)
    assert index.has_chunks("__0_0.distcp") and not reads  # known without a read
    assert index.chunks("__0_0.distcp") == CHUNKS[0]
    assert index.entry("__0_0.distcp").chunk(4, 6) == mf.Chunk(4, 6, 0xB)
    assert index.chunks("__1_0.distcp") == CHUNKS[1]
    assert reads == ["__0.records", "__1.records"] == index.loaded
    assert index.chunks("__0.records") == ()  # the small files have no records file
    assert index.record("__0_0.distcp", 4, 6) == mf.Chunk(4, 6, 0xB)
    assert index.record("__0_0.distcp", 4, 5) is None


def test_inline_chunks_of_an_older_manifest_win_and_nothing_is_read() -> None:
    index = records.ChunkIndex(_manifest({}, inline=True), lambda n: pytest.fail(n))
    assert index.chunks("__1_0.distcp") == CHUNKS[1] and index.has_chunks("__1_0.distcp")
    without = records.ChunkIndex(_manifest({}), lambda n: pytest.fail(n))
    assert without.chunks("__0_0.distcp") == () and not without.has_chunks("__0_0.distcp")


def test_a_records_file_that_does_not_match_the_manifest_is_refused() -> None:
    good = _rec(0)
    bad = good[:-3] + b"9\"]" if good[-3:] != b"9\"]" else good[:-3] + b"8\"]"
    index = records.ChunkIndex(_manifest({0: good}), lambda n: bad, location="s3://b/x")
    with pytest.raises(IntegrityError, match=r"s3://b/x/__0\.records: .* CRC32C"):
        index.chunks("__0_0.distcp")


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(rank=1), "records file of rank 0"),
    (lambda d: d.update(format_version=9), "format-1"),
    (lambda d: d["files"].update({"__1_0.distcp": []}), "which rank 1 wrote"),
    (lambda d: d["files"].update({"__0_0.distcp": [[0, 11, "0"]]}), "outside the file"),
    (lambda d: d["files"].update({"../x": []}), "unsafe"),
])
def test_malformed_records_are_integrity_errors(edit: object, match: str) -> None:
    body = json.loads(_rec(0))
    edit(body)  # type: ignore[operator]
    data = json.dumps(body).encode()
    index = records.ChunkIndex(_manifest({0: data}), lambda n: data)
    with pytest.raises(IntegrityError, match=match):
        index.chunks("__0_0.distcp")
