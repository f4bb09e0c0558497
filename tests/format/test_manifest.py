from __future__ import annotations

import json
from collections.abc import Iterable

import pytest

from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import manifest as mf


def _m(**kw: object) -> mf.Manifest:
    base: dict = dict(step=5, world_size=2, save_id="abc-5", domains=((0, 1),),
                      files=(mf.FileEntry(name="__0_0.distcp", size=10, crc32c=0xDEADBEEF, rank=0),
                             mf.FileEntry(name="__1_0.distcp", size=7, crc32c=1, rank=1),
                             mf.FileEntry(name=".metadata", size=3, crc32c=2)))
    base.update(kw)
    return mf.Manifest(**base)


def test_roundtrip_is_canonical() -> None:
    m = _m()
    b = m.to_bytes()
    assert mf.Manifest.from_bytes(b) == m
    assert mf.Manifest.from_bytes(b).to_bytes() == b
    assert m.total_bytes == 20


def test_files_for_ranks_includes_shared_files() -> None:
    names = {f.name for f in _m().files_for_ranks([1])}
    assert names == {"__1_0.distcp", ".metadata"}


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", "", "a\\b", "x\x00"])
def test_unsafe_member_names_are_refused(name: str) -> None:
    d = json.loads(_m().to_bytes())
    d["files"][0]["name"] = name
    with pytest.raises(IntegrityError, match="unsafe"):
        mf.Manifest.from_bytes(json.dumps(d).encode())


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("files"),
    lambda d: d.__setitem__("format_version", 99),
    lambda d: d["files"][0].__setitem__("size", -1),
    lambda d: d["files"][0].__setitem__("crc32c", "zz"),
    lambda d: d["files"].append(dict(d["files"][0])),
    lambda d: d.__setitem__("world_size", 0),
])
def test_malformed_manifest_is_integrity_error(mutate: object) -> None:
    d = json.loads(_m().to_bytes())
    mutate(d)  # type: ignore[operator]
    with pytest.raises(IntegrityError):
        mf.Manifest.from_bytes(json.dumps(d).encode())


def test_marker_vouches_for_exact_manifest_bytes() -> None:
    b = _m().to_bytes()
    marker = mf.marker_bytes(b, 5, "abc-5")
    assert mf.verify_marker(marker, b) == _m()
    with pytest.raises(IntegrityError, match="digest"):
        mf.verify_marker(marker, b.replace(b'"size":10', b'"size":11'))
    with pytest.raises(IntegrityError, match="malformed"):
        mf.verify_marker(b"not json", b)
    other = mf.marker_bytes(b, 6, "abc-5")
    with pytest.raises(IntegrityError, match="disagree"):
        mf.verify_marker(other, b)


def test_signing_refuses_unsigned_and_wrong_key() -> None:
    b = _m().to_bytes()
    signed = mf.marker_bytes(b, 5, "abc-5", key=b"k1")
    assert mf.verify_marker(signed, b, key=b"k1").step == 5
    with pytest.raises(SignatureError, match="does not verify"):
        mf.verify_marker(signed, b, key=b"k2")
    with pytest.raises(SignatureError, match="unsigned"):
        mf.verify_marker(mf.marker_bytes(b, 5, "abc-5"), b, key=b"k1")


def _with_chunks(chunks: list) -> bytes:
    body = json.loads(_m().to_bytes())
    body["files"][0]["chunks"] = chunks
    return json.dumps(body).encode()


def test_chunks_roundtrip_and_lookup() -> None:
    chunks = (mf.Chunk(0, 4, 0xA), mf.Chunk(4, 6, 0xB))
    e = mf.FileEntry(name="__0_0.distcp", size=10, crc32c=1, rank=0, chunks=chunks)
    m = _m(files=(e,))
    again = mf.Manifest.from_bytes(m.to_bytes())
    assert again == m and again.file("__0_0.distcp").chunk(4, 6) == mf.Chunk(4, 6, 0xB)
    assert again.file("__0_0.distcp").chunk(4, 5) is None


def test_entries_without_chunks_serialise_as_before() -> None:
    # an older manifest (no "chunks" key) parses and re-serialises to the same bytes
    assert "chunks" not in _m().to_bytes().decode()
    assert mf.Manifest.from_bytes(_m().to_bytes()).files[0].chunks == ()


@pytest.mark.parametrize("chunks", [
    [[0, 11, "0000000a"]],                       # past the end of the 10-byte file
    [[0, 6, "0000000a"], [5, 2, "0000000b"]],    # overlapping
    [[0, "4", "0000000a"]],                      # not an int
    [[0, 4]],                                    # no crc
    [[0, 4, "xyz"]],                             # bad crc
    "0:4:a",                                     # not a list
])
def test_malformed_chunks_are_integrity_errors(chunks: object) -> None:
    with pytest.raises(IntegrityError):
        mf.Manifest.from_bytes(_with_chunks(chunks))  # type: ignore[arg-type]


def _ranks(world: int) -> list[mf.FileEntry]:
    files = [mf.FileEntry(name=f"__{r}_0.distcp", size=100 + r, crc32c=r, rank=r)
             for r in range(world)]
    return [*files, mf.FileEntry(name=".metadata", size=3, crc32c=2)]


def _parts(files: Iterable[mf.FileEntry], step: int, save_id: str, world: int
           ) -> dict[str, bytes]:
    return mf.parts_of(mf.Manifest(step=step, world_size=world, save_id=save_id,
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
        got = mf.verify_part(marker, name, parts[name], rank=rank)
        lo = rank // 8 * 8
        assert {f.name for f in got.files} == \
            {".metadata", *(f"__{r}_0.distcp" for r in range(lo, min(lo + 8, 20)))}
        assert (got.step, got.save_id, got.world_size) == (5, "abc-5", 20)
    # the manifest lists every part as a shared file (every domain holds them all)
    entries = mf.part_entries(parts)
    assert [e.rank for e in entries] == [None] * 3
    assert [e.size for e in entries] == [len(b) for b in parts.values()]


def test_a_part_is_checked_against_its_marker() -> None:
    parts = _parts(_ranks(16), 5, "abc-5", 16)
    marker = mf.marker_bytes(b"m", 5, "abc-5", parts=parts)
    name, other = "manifest.00000.json", "manifest.00001.json"
    with pytest.raises(IntegrityError, match="digest does not match"):
        mf.verify_part(marker, name, parts[name].replace(b'"size":100', b'"size":101'), rank=0)
    with pytest.raises(IntegrityError, match="not the manifest part of rank 9"):
        mf.verify_part(marker, name, parts[name], rank=9)  # another group's part
    with pytest.raises(IntegrityError, match="does not vouch"):
        mf.verify_part(mf.marker_bytes(b"m", 5, "abc-5"), name, parts[name], rank=0)
    # a part of another checkpoint, vouched for by a marker that names it (a mix-up)
    stale = _parts(_ranks(16), 4, "abc-4", 16)
    mixed = mf.marker_bytes(b"m", 5, "abc-5", parts={**parts, other: stale[other]})
    with pytest.raises(IntegrityError, match="disagrees with its COMPLETE marker"):
        mf.verify_part(mixed, other, stale[other], rank=8)


def test_signed_parts_refuse_unsigned_and_wrong_key() -> None:
    parts = _parts(_ranks(2), 5, "abc-5", 2)
    name = "manifest.00000.json"
    signed = mf.marker_bytes(b"m", 5, "abc-5", key=b"k1", parts=parts)
    assert mf.verify_part(signed, name, parts[name], b"k1", rank=1).step == 5
    with pytest.raises(SignatureError, match="does not verify"):
        mf.verify_part(signed, name, parts[name], b"k2", rank=1)
    with pytest.raises(SignatureError, match="unsigned"):
        mf.verify_part(mf.marker_bytes(b"m", 5, "abc-5", parts=parts), name, parts[name],
                       b"k1", rank=1)


def test_a_sealed_manifest_lists_its_parts_and_rebuilds_them() -> None:
    m = mf.Manifest(step=5, world_size=12, save_id="abc-5", files=tuple(_ranks(12)))
    sealed = mf.seal(m, key=b"k1")
    assert list(sealed.parts) == ["manifest.00000.json", "manifest.00001.json"]
    assert mf.Manifest.from_bytes(sealed.manifest_bytes) == sealed.manifest
    assert mf.verify_marker(sealed.marker_bytes, sealed.manifest_bytes, key=b"k1") \
        == sealed.manifest
    assert mf.rebuild_parts(mf.Manifest.from_bytes(sealed.manifest_bytes)) == sealed.parts
    wrong = tuple(f if f.name != "manifest.00001.json" else
                  mf.FileEntry(name=f.name, size=f.size, crc32c=f.crc32c ^ 1)
                  for f in sealed.manifest.files)
    with pytest.raises(IntegrityError, match="differ from the ones it lists"):
        mf.rebuild_parts(mf.Manifest(step=5, world_size=12, save_id="abc-5", files=wrong))


def _sealed(world: int = 20) -> mf.Sealed:
    domains = tuple(tuple(range(lo, min(lo + 3, world))) for lo in range(0, world, 3))
    return mf.seal(mf.Manifest(step=5, world_size=world, save_id="abc-5",
                               files=tuple(_ranks(world)), domains=domains,
                               created_unix=1234.5678, torch_version="2.13.0",
                               tierckpt_version="0.3.0"), key=b"k1")


def test_the_first_part_carries_the_header_the_others_do_not() -> None:
    sealed = _sealed()
    first, second, _ = sealed.parts
    head = mf.verify_part(sealed.marker_bytes, first, sealed.parts[first], b"k1")
    assert mf.has_header(head) and head.domains == sealed.manifest.domains
    assert (head.created_unix, head.torch_version) == (1234.5678, "2.13.0")
    other = mf.verify_part(sealed.marker_bytes, second, sealed.parts[second], b"k1")
    assert not mf.has_header(other) and b"header" not in sealed.parts[second]


def test_the_parts_alone_rebuild_the_manifest_byte_for_byte() -> None:
    sealed = _sealed()
    rebuilt = mf.assemble(sealed.parts)
    assert rebuilt == sealed.manifest_bytes
    assert mf.verify_marker(sealed.marker_bytes, rebuilt, key=b"k1") == sealed.manifest
    # one part short: the rebuilt manifest is another one, and the marker says so
    short = dict(sealed.parts)
    short.pop("manifest.00001.json")
    with pytest.raises(IntegrityError, match="digest does not match"):
        mf.verify_marker(sealed.marker_bytes, mf.assemble(short), key=b"k1")


def test_parts_that_cannot_rebuild_a_manifest_say_why() -> None:
    sealed = _sealed()
    _, second, third = sealed.parts
    with pytest.raises(IntegrityError, match="no manifest parts"):
        mf.assemble({})
    with pytest.raises(IntegrityError, match="carries no manifest header"):
        mf.assemble({second: sealed.parts[second], third: sealed.parts[third]})
    changed = sealed.parts[second].replace(b'"size":3', b'"size":4')  # .metadata's entry
    with pytest.raises(IntegrityError, match=r"disagree about \.metadata"):
        mf.assemble({**sealed.parts, second: changed})
    stale = _parts(_ranks(20), 4, "abc-4", 20)
    with pytest.raises(IntegrityError, match="another checkpoint"):
        mf.assemble({**sealed.parts, third: stale[third]})
    with pytest.raises(IntegrityError, match="malformed"):
        mf.assemble({**sealed.parts, third: b"{"})
