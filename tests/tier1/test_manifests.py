"""tier1.manifests: bounded, verified reads of a checkpoint's marker, manifest and parts,
on real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._synthetic import make_checkpoint
from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.tier1 import manifests
from tierckpt.tier1.catalog import Tier1Catalog

FILES = {"__0_0.distcp": (1000, 0), ".metadata": (100, None)}


def test_read_committed_verifies_marker_name_and_bound(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m = make_checkpoint(tmp_path, 4, FILES)
    cat = Tier1Catalog(tmp_path)
    got = cat.read_committed(4)
    assert got.manifest == m and got.marker_bytes == (cat.step_dir(4) / "COMPLETE").read_bytes()
    os.rename(cat.step_dir(4), cat.step_dir(9))
    with pytest.raises(IntegrityError, match="named for step 9 but its manifest is step 4"):
        cat.read_committed(9)
    monkeypatch.setattr(manifests, "MANIFEST_LIMIT", 10)
    with pytest.raises(IntegrityError, match=r"manifest\.json is larger than 10 bytes"):
        manifests.read_committed(cat.step_dir(9), step=None)
    (cat.step_dir(9) / layout.COMPLETE).unlink()
    with pytest.raises(IntegrityError, match="no COMPLETE marker"):
        cat.read_committed(9)


def test_a_manifest_over_the_small_file_bound_is_read(tmp_path: Path) -> None:
    """A manifest grows with ranks × tensors (386 MiB for a 70B state at 4,096 ranks): one
    past the 64 MiB bound of markers and records is still a checkpoint's manifest."""
    m = make_checkpoint(tmp_path, 4, FILES)
    d = Tier1Catalog(tmp_path).step_dir(4)
    big = m.to_bytes()[:-1] + b" " * (manifests.SMALL_FILE_LIMIT + 1) + b"\n"  # still its JSON
    (d / layout.MANIFEST).write_bytes(big)
    (d / layout.COMPLETE).unlink()
    (d / layout.COMPLETE).write_bytes(mf.marker_bytes(big, m.step, m.save_id))
    assert len(big) > manifests.SMALL_FILE_LIMIT
    assert manifests.read_committed(d, step=4).manifest == m


def _sealed(root: Path, step: int = 4, key: bytes | None = None) -> mf.Manifest:
    """20 ranks in domains of 3 (straddling the parts of 8), sealed with parts."""
    files: dict[str, tuple[int, int | None]] = {
        f"__{r}_0.distcp": (50 + r, r) for r in range(20)}
    files[".metadata"] = (40, None)
    domains = tuple(tuple(range(lo, min(lo + 3, 20))) for lo in range(0, 20, 3))
    return make_checkpoint(root, step, files, domains=domains, world_size=20, sealed=True,
                           key=key)


@pytest.mark.parametrize("damage", ["flip", "delete", "truncate"])
def test_a_damaged_manifest_is_rebuilt_from_its_parts(
        tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(mf.SIGNING_KEY_ENV, "k1")
    m = _sealed(tmp_path, key=b"k1")
    d = Tier1Catalog(tmp_path).step_dir(4)
    intact = manifests.read_committed(d, step=4)
    p = d / layout.MANIFEST
    if damage == "flip":
        data = bytearray(p.read_bytes())
        data[len(data) // 3] ^= 0x04
        p.write_bytes(bytes(data))
    elif damage == "delete":
        p.unlink()
    else:
        os.truncate(p, 10)
    got = manifests.read_committed(d, step=4)
    assert got == intact and got.manifest == m
    assert "rebuilt from its manifest parts" in caplog.text
    # a part damaged as well: nothing vouches for a rebuilt manifest, the first reason stands
    part = d / layout.part_filename(9)
    part.write_bytes(part.read_bytes().replace(b'"size":59', b'"size":58'))
    with pytest.raises(IntegrityError, match=r"manifest\.json|digest does not match"):
        manifests.read_committed(d, step=4)


def test_a_rebuild_is_refused_under_another_key(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _sealed(tmp_path, key=b"k1")
    d = Tier1Catalog(tmp_path).step_dir(4)
    (d / layout.MANIFEST).unlink()
    monkeypatch.setenv(mf.SIGNING_KEY_ENV, "k2")
    with pytest.raises(SignatureError):
        manifests.read_committed(d, step=4)


def test_a_domain_on_its_saved_layout_reads_only_its_parts(tmp_path: Path) -> None:
    m = _sealed(tmp_path)
    d = Tier1Catalog(tmp_path).step_dir(4)
    for name in ("manifest.00002.json", layout.MANIFEST):  # not needed by ranks 6..8
        (d / name).unlink()
    view = manifests.read_domain(d, step=4, domain=(6, 7, 8), world_size=20)
    assert view is not None and view.domains == m.domains and view.world_size == 20
    want = [f for f in m.files if f.rank in (6, 7, 8) or f.name in
            (".metadata", "manifest.00000.json", "manifest.00001.json")]
    assert sorted(view.files, key=lambda f: f.name) == sorted(want, key=lambda f: f.name)
    # not the saved layout: the caller reads the whole manifest
    assert manifests.read_domain(d, step=4, domain=(6, 7, 8), world_size=21) is None
    assert manifests.read_domain(d, step=4, domain=(6, 7), world_size=20) is None
    with pytest.raises(IntegrityError, match="renamed by hand"):
        manifests.read_domain(d, step=5, domain=(6, 7, 8), world_size=20)
    with pytest.raises(IntegrityError, match=r"manifest\.00002\.json but it is missing"):
        manifests.read_domain(d, step=4, domain=(15, 16, 17), world_size=20)
    part = d / "manifest.00001.json"
    part.write_bytes(part.read_bytes()[:-2] + b" \n")
    with pytest.raises(IntegrityError, match=r"digest does not match manifest\.00001\.json"):
        manifests.read_domain(d, step=4, domain=(6, 7, 8), world_size=20)


def test_parts_without_the_header_leave_the_domain_to_the_manifest(tmp_path: Path) -> None:
    """Checkpoints saved when parts carried no header (before the manifest could be rebuilt
    from them): the domain reads the whole manifest, as it did then."""
    m = make_checkpoint(tmp_path, 4, FILES, domains=((0,),), world_size=1)
    d = Tier1Catalog(tmp_path).step_dir(4)
    name = layout.part_filename(0)
    old = mf.canonical({"format_version": 1, "step": 4, "save_id": m.save_id,
                         "world_size": 1, "part": name,
                         "files": [f.to_json() for f in m.files]})
    (d / name).write_bytes(old)
    (d / layout.COMPLETE).unlink()
    (d / layout.COMPLETE).write_bytes(mf.marker_bytes((d / layout.MANIFEST).read_bytes(), 4,
                                                      m.save_id, parts={name: old}))
    assert manifests.read_domain(d, step=4, domain=(0,), world_size=1) is None
    assert manifests.read_committed(d, step=4).manifest == m
    (d / layout.MANIFEST).unlink()  # and with no header nothing rebuilds a lost manifest
    with pytest.raises(IntegrityError, match=r"manifest\.json missing"):
        manifests.read_committed(d, step=4)
