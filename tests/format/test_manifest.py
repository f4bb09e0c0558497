from __future__ import annotations

import json

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
