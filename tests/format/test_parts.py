"""format.parts: the manifest cut per group of ranks, each part checked against the marker
alone, and the parts rebuilding the manifest byte for byte."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import manifest as mf
from tierckpt.format.parts import (
    Sealed,
    assemble,
    has_header,
    part_entries,
    parts_of,
    rebuild_parts,
    seal,
    verify_part,
)


def _ranks(world: int) -> list[mf.FileEntry]:
    files = [mf.FileEntry(name=f"__{r}_0.distcp", size=100 + r, crc32c=r, rank=r)
             for r in range(world)]
    return [*files, mf.FileEntry(name=".metadata", size=3, crc32c=2)]


def _parts(files: Iterable[mf.FileEntry], step: int, save_id: str, world: int
           ) -> dict[str, bytes]:
    return parts_of(mf.Manifest(step=step, world_size=world, save_id=save_id,
                                   files=tuple(files)))


def test_parts_group_eight_ranks_with_the_shared_files() -> None:
    files = _ranks(20)
    parts = _parts(files, 5, "abc-5", 20)
    assert list(parts) == ["manifest.00000.json", "manifest.00001.json", "manifest.00002.json"]
    assert parts == _parts(reversed(files), 5, "abc-5", 20)
    marker = mf.marker_bytes(b"m", 5, "abc-5", parts=parts)
    assert mf.marker_parts(marker) and not mf.marker_parts(mf.marker_bytes(b"m", 5, "abc-5"))
    for rank in (0, 9, 19):
        name = f"manifest.{rank // 8:05d}.json"
        got = verify_part(marker, name, parts[name], rank=rank)
        lo = rank // 8 * 8
        assert {f.name for f in got.files} == \
            {".metadata", *(f"__{r}_0.distcp" for r in range(lo, min(lo + 8, 20)))}
        assert (got.step, got.save_id, got.world_size) == (5, "abc-5", 20)
    # the manifest lists every part as a shared file (every domain holds them all)
    entries = part_entries(parts)
    assert [e.rank for e in entries] == [None] * 3
    assert [e.size for e in entries] == [len(b) for b in parts.values()]


def test_a_part_is_checked_against_its_marker() -> None:
    parts = _parts(_ranks(16), 5, "abc-5", 16)
    marker = mf.marker_bytes(b"m", 5, "abc-5", parts=parts)
    name, other = "manifest.00000.json", "manifest.00001.json"
    with pytest.raises(IntegrityError, match="digest does not match"):
        verify_part(marker, name, parts[name].replace(b'"size":100', b'"size":101'), rank=0)
    with pytest.raises(IntegrityError, match="not the manifest part of rank 9"):
        verify_part(marker, name, parts[name], rank=9)  # another group's part
    with pytest.raises(IntegrityError, match="does not vouch"):
        verify_part(mf.marker_bytes(b"m", 5, "abc-5"), name, parts[name], rank=0)
    # a part of another checkpoint, vouched for by a marker that names it (a mix-up)
    stale = _parts(_ranks(16), 4, "abc-4", 16)
    mixed = mf.marker_bytes(b"m", 5, "abc-5", parts={**parts, other: stale[other]})
    with pytest.raises(IntegrityError, match="disagrees with its COMPLETE marker"):
        verify_part(mixed, other, stale[other], rank=8)


def test_signed_parts_refuse_unsigned_and_wrong_key() -> None:
    parts = _parts(_ranks(2), 5, "abc-5", 2)
    name = "manifest.00000.json"
    signed = mf.marker_bytes(b"m", 5, "abc-5", key=b"k1", parts=parts)
    assert verify_part(signed, name, parts[name], b"k1", rank=1).step == 5
    with pytest.raises(SignatureError, match="does not verify"):
        verify_part(signed, name, parts[name], b"k2", rank=1)
    with pytest.raises(SignatureError, match="unsigned"):
        verify_part(mf.marker_bytes(b"m", 5, "abc-5", parts=parts), name, parts[name],
                       b"k1", rank=1)


def test_a_sealed_manifest_lists_its_parts_and_rebuilds_them() -> None:
    m = mf.Manifest(step=5, world_size=12, save_id="abc-5", files=tuple(_ranks(12)))
    sealed = seal(m, key=b"k1")
    assert list(sealed.parts) == ["manifest.00000.json", "manifest.00001.json"]
    assert mf.Manifest.from_bytes(sealed.manifest_bytes) == sealed.manifest
    assert mf.verify_marker(sealed.marker_bytes, sealed.manifest_bytes, key=b"k1") \
        == sealed.manifest
    assert rebuild_parts(mf.Manifest.from_bytes(sealed.manifest_bytes)) == sealed.parts
    wrong = tuple(f if f.name != "manifest.00001.json" else
                  mf.FileEntry(name=f.name, size=f.size, crc32c=f.crc32c ^ 1)
                  for f in sealed.manifest.files)
    with pytest.raises(IntegrityError, match="differ from the ones it lists"):
        rebuild_parts(mf.Manifest(step=5, world_size=12, save_id="abc-5", files=wrong))


def _sealed(world: int = 20) -> Sealed:
    domains = tuple(tuple(range(lo, min(lo + 3, world))) for lo in range(0, world, 3))
    return seal(mf.Manifest(step=5, world_size=world, save_id="abc-5",
                               files=tuple(_ranks(world)), domains=domains,
                               created_unix=1234.5678, torch_version="2.13.0",
                               tierckpt_version="0.3.0"), key=b"k1")


def test_the_first_part_carries_the_header_the_others_do_not() -> None:
    sealed = _sealed()
    first, second, _ = sealed.parts
    head = verify_part(sealed.marker_bytes, first, sealed.parts[first], b"k1")
    assert has_header(head) and head.domains == sealed.manifest.domains
    assert (head.created_unix, head.torch_version) == (1234.5678, "2.13.0")
    other = verify_part(sealed.marker_bytes, second, sealed.parts[second], b"k1")
    assert not has_header(other) and b"header" not in sealed.parts[second]


def test_the_parts_alone_rebuild_the_manifest_byte_for_byte() -> None:
    sealed = _sealed()
    rebuilt = assemble(sealed.parts)
    assert rebuilt == sealed.manifest_bytes
    assert mf.verify_marker(sealed.marker_bytes, rebuilt, key=b"k1") == sealed.manifest
    # one part short: the rebuilt manifest is another one, and the marker says so
    short = dict(sealed.parts)
    short.pop("manifest.00001.json")
    with pytest.raises(IntegrityError, match="digest does not match"):
        mf.verify_marker(sealed.marker_bytes, assemble(short), key=b"k1")


def test_parts_that_cannot_rebuild_a_manifest_say_why() -> None:
    sealed = _sealed()
    _, second, third = sealed.parts
    with pytest.raises(IntegrityError, match="no manifest parts"):
        assemble({})
    with pytest.raises(IntegrityError, match="carries no manifest header"):
        assemble({second: sealed.parts[second], third: sealed.parts[third]})
    changed = sealed.parts[second].replace(b'"size":3', b'"size":4')  # .metadata's entry
    with pytest.raises(IntegrityError, match=r"disagree about \.metadata"):
        assemble({**sealed.parts, second: changed})
    stale = _parts(_ranks(20), 4, "abc-4", 20)
    with pytest.raises(IntegrityError, match="another checkpoint"):
        assemble({**sealed.parts, third: stale[third]})
    with pytest.raises(IntegrityError, match="malformed"):
        assemble({**sealed.parts, third: b"{"})
