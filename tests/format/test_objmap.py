"""The object map of a content-addressed tier-2 step: keys, its own digest, its binding to
the manifest, signing, merging parts. Pure values, no files."""

from __future__ import annotations

import hashlib

import pytest

from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import manifest as mf
from tierckpt.format import objmap


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


FILES = (mf.FileEntry(name="__0_0.distcp", size=3, crc32c=7, rank=0),
         mf.FileEntry(name=".metadata", size=2, crc32c=9))
MANIFEST = mf.Manifest(step=4, world_size=1, save_id="s", files=FILES)
MBYTES = MANIFEST.to_bytes()


def _map(**kw: object) -> objmap.ObjectMap:
    entries = tuple(objmap.MapEntry(name=f.name, size=f.size, crc32c=f.crc32c,
                                    sha256=_sha(f.name.encode())) for f in FILES)
    return objmap.ObjectMap(**{"step": 4, "manifest_sha256": mf.digest(MBYTES),
                               "entries": entries, "uploaded": 3, **kw})  # type: ignore[arg-type]


def test_keys_are_the_sha256_of_the_bytes_and_nothing_else() -> None:
    assert objmap.content_key(_sha(b"x")) == f"objects/sha256/{_sha(b'x')}"
    for bad in ("", "../x", _sha(b"x").upper(), _sha(b"x")[:-1]):
        with pytest.raises(IntegrityError):
            objmap.content_key(bad)
    assert objmap.is_part(objmap.part_name("r00003")) and not objmap.is_part(objmap.MAP)
    with pytest.raises(ValueError):
        objmap.part_name("../x")


def test_round_trip_damage_and_binding_to_the_manifest() -> None:
    m = _map()
    back = objmap.ObjectMap.from_bytes(m.to_bytes())
    assert back == m and back.referenced == 5 and back.keys()[".metadata"].endswith(
        _sha(b".metadata"))
    back.check(MANIFEST, MBYTES)
    damaged = m.to_bytes().replace(b'"uploaded":3', b'"uploaded":4')
    with pytest.raises(IntegrityError, match="own digest"):
        objmap.ObjectMap.from_bytes(damaged)
    other = mf.Manifest(step=4, world_size=1, save_id="t", files=FILES).to_bytes()
    with pytest.raises(IntegrityError, match="another manifest"):
        m.check(MANIFEST, other)
    lying = _map(entries=(objmap.MapEntry(name=".metadata", size=2, crc32c=8,
                                          sha256=_sha(b"m")),))
    with pytest.raises(IntegrityError, match="disagrees"):
        lying.check(MANIFEST, MBYTES, complete=False)
    part = _map(entries=_map().entries[:1])
    part.check(MANIFEST, MBYTES, complete=False)
    with pytest.raises(IntegrityError, match="every file"):
        part.check(MANIFEST, MBYTES)


def test_a_signing_key_requires_a_signed_map() -> None:
    key = b"k" * 32
    m = _map()
    assert objmap.ObjectMap.from_bytes(m.to_bytes(key), key) == m
    with pytest.raises(SignatureError):
        objmap.ObjectMap.from_bytes(m.to_bytes(), key)
    with pytest.raises(SignatureError):
        objmap.ObjectMap.from_bytes(m.to_bytes(b"j" * 32), key)


def test_parts_merge_into_one_map_and_disagreements_are_refused() -> None:
    whole = _map()
    a = _map(entries=whole.entries[:1], uploaded=1)
    b = _map(entries=whole.entries, uploaded=2)  # a shared file listed by both nodes
    merged = objmap.merge([a, b])
    assert merged.entries == whole.entries and merged.uploaded == 3
    liar = _map(entries=(objmap.MapEntry(name=whole.entries[0].name, size=1, crc32c=1,
                                         sha256=_sha(b"z")),))
    with pytest.raises(IntegrityError, match="disagree"):
        objmap.merge([a, liar])
    with pytest.raises(IntegrityError):
        objmap.merge([])
