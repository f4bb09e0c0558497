"""Content-addressed tier 2 (tier2/uploader/content.py and its readers): an object already
on tier 2 is never uploaded again, every step restores on its own from tier 2 alone, a
damaged shared object is caught on every read, and steps of the old layout still work."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from s3server import S3Env

from tests._synthetic import make_checkpoint
from tierckpt.errors import BadDigestError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.ops.check import check_tier2
from tierckpt.policy import uploads
from tierckpt.runtime import events
from tierckpt.tier1 import fs
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.fetch import fetch_into_tier1
from tierckpt.tier2.storage import LocalStorage, ObjectInfo, Storage, open_storage
from tierckpt.tier2.uploader import content
from tierckpt.tier2.uploader.transfer import upload_step

KiB = 1024
BASE = {".metadata": (300, None), "__0_0.distcp": (96 * KiB, 0),
        "__0_1.distcp": (4 * KiB, 0), "__0.metadata": (500, 0)}
"""A frozen base (``__0_0``: most bytes), adapters (``__0_1``) and small files."""


def derive(root: Path, src: int, step: int, changed: set[str],
           linked: frozenset[str] = frozenset()) -> mf.Manifest:
    """A committed checkpoint ``step`` with ``src``'s files, ``changed`` ones rewritten,
    ``linked`` ones hard-linked (as incremental saves link a frozen file)."""
    rng, d = random.Random(step), root / layout.step_dirname(step)
    d.mkdir()
    entries = []
    for f in mf.verify_marker((root / layout.step_dirname(src) / layout.COMPLETE)
                              .read_bytes(), (root / layout.step_dirname(src) /
                                              layout.MANIFEST).read_bytes()).files:
        data = (root / layout.step_dirname(src) / f.name).read_bytes()
        if f.name in changed:
            data = rng.randbytes(len(data))
        if f.name in linked:
            os.link(root / layout.step_dirname(src) / f.name, d / f.name)
        else:
            fs.write_durably(d / f.name, data)
        entries.append(mf.FileEntry(name=f.name, size=len(data), rank=f.rank,
                                    crc32c=checksum.extend(0, data)))
    m = mf.Manifest(step=step, world_size=1, save_id=f"save{step}", files=tuple(entries))
    fs.write_durably(d / layout.MANIFEST, m.to_bytes())
    fs.write_durably(d / layout.COMPLETE, mf.marker_bytes(m.to_bytes(), step, m.save_id))
    return m


class Counting:
    """A storage that counts the bytes of every object put (a fake wrapper, not a mock)."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.put_bytes_total = inner, 0
        self.puts: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_file(self, key: str, path: Any, *, crc32c: int, size: int) -> ObjectInfo:
        self.puts.append(key)
        self.put_bytes_total += size
        return self.inner.put_file(key, path, crc32c=crc32c, size=size)


def _upload(t1: Path, remote: Tier2Catalog, step: int) -> int:
    r = upload_step(Tier1Catalog(t1), remote, step, log=events.EventLog(t1 / layout.EVENTS))
    assert r.status == "verified", r
    return r.bytes


def _restores_from_tier2_alone(remote: Tier2Catalog, src: Path, fresh: Path,
                               step: int) -> None:
    fresh.mkdir(exist_ok=True)
    got, reused = fetch_into_tier1(remote, Tier1Catalog(fresh), step, names=None)
    assert reused == 0 and got > 0
    for p in (src / layout.step_dirname(step)).iterdir():
        assert (fresh / layout.step_dirname(step) / p.name).read_bytes() == p.read_bytes()


def test_shared_files_upload_once_and_both_steps_restore_file(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"})
    keep = tmp_path / "expected"
    shutil.copytree(t1, keep)
    counting = Counting(LocalStorage(t2))
    remote = Tier2Catalog(counting)  # type: ignore[arg-type]
    first, second = _upload(t1, remote, 1), _upload(t1, remote, 2)
    assert first == sum(s for s, _ in BASE.values()) and second == BASE["__0_1.distcp"][0]
    assert len(counting.puts) == len(set(counting.puts)) == len(BASE) + 1
    assert sum(remote.content().values()) == first + second
    summary = uploads.summarize(events.read_events(t1 / layout.EVENTS))  # what report shows
    assert (summary.verified, summary.bytes, summary.referenced) == (
        2, first + second, 2 * sum(s for s, _ in BASE.values()))
    shutil.rmtree(t1)
    for step in (1, 2):
        _restores_from_tier2_alone(remote, keep, tmp_path / "fresh", step)
        assert check_tier2(LocalStorage(t2), step).ok


@pytest.mark.slow
def test_shared_files_upload_once_on_the_s3_servers(tmp_path: Path, s3_env: S3Env) -> None:
    t1 = tmp_path / "t1"
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"})
    keep = tmp_path / "expected"
    shutil.copytree(t1, keep)
    with open_storage(s3_env.url) as st:
        remote = Tier2Catalog(st)
        assert (_upload(t1, remote, 1), _upload(t1, remote, 2)) == (
            sum(s for s, _ in BASE.values()), BASE["__0_1.distcp"][0])
        objects = [k for k in s3_env.keys() if k.startswith("objects/sha256/")]  # noqa: SIM118
        assert len(objects) == len(BASE) + 1
        shutil.rmtree(t1)
        for step in (1, 2):
            _restores_from_tier2_alone(remote, keep, tmp_path / "fresh", step)
            assert check_tier2(st, step).ok


def test_a_step_uploaded_again_sends_no_object(tmp_path: Path) -> None:
    """Re-promotion: a step whose tier-2 copy was deleted (content still referenced by a
    newer step) is uploaded again from tier 1 without a byte of its files."""
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed=set())  # nothing changed: an eval-only interval
    remote = Tier2Catalog(LocalStorage(t2))
    assert _upload(t1, remote, 1) > 0 and _upload(t1, remote, 2) == 0
    remote.delete(1)
    assert remote.complete_steps() == [2] and len(remote.content()) == len(BASE)
    assert _upload(t1, remote, 1) == 0
    assert check_tier2(LocalStorage(t2), 1).ok


def test_a_damaged_shared_object_is_caught_on_fetch_and_verify(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"})
    remote = Tier2Catalog(LocalStorage(t2))
    _upload(t1, remote, 1)
    _upload(t1, remote, 2)
    key = remote.resolve(2).key("__0_0.distcp")
    assert key == remote.resolve(1).key("__0_0.distcp")
    p = t2 / key
    data = bytearray(p.read_bytes())
    data[1000] ^= 0x10
    p.write_bytes(bytes(data))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(BadDigestError):
        fetch_into_tier1(remote, Tier1Catalog(fresh), 2, names=None)
    assert not (fresh / layout.step_dirname(2)).exists()
    for step in (1, 2):  # loud on every step that shares it, never silent
        report = check_tier2(LocalStorage(t2), step)
        assert not report.ok and "__0_0.distcp" in (report.error or "")


def test_a_step_of_the_old_layout_still_reads(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    make_checkpoint(t1, 3, BASE)
    st = LocalStorage(t2)
    d = t1 / layout.step_dirname(3)
    for name in (*BASE, layout.MANIFEST, layout.COMPLETE):  # as tierckpt wrote it before
        st.put_bytes(Tier2Catalog.key(3, name), (d / name).read_bytes())
    remote = Tier2Catalog(st)
    where = remote.resolve(3)
    assert where.objmap is None and where.key("__0_0.distcp") == "step-00000003/__0_0.distcp"
    assert check_tier2(st, 3).ok
    _restores_from_tier2_alone(remote, t1, tmp_path / "fresh", 3)


def test_a_hard_linked_file_is_hashed_once(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Incremental saves link the frozen file into every step: the uploader reads it for
    its SHA-256 once; a file written anew (a new inode) or in place (a new mtime) is read."""
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"}, linked=frozenset({"__0_0.distcp"}))
    read: list[str] = []
    real = content.sha256_of

    def counting(path: Path, stop: Any = None) -> str:
        read.append(f"{path.parent.name}/{path.name}")
        return real(path, stop)

    monkeypatch.setattr(content, "sha256_of", counting)
    remote = Tier2Catalog(LocalStorage(t2))
    _upload(t1, remote, 1)
    _upload(t1, remote, 2)
    assert "step-00000001/__0_0.distcp" in read
    assert "step-00000002/__0_0.distcp" not in read  # the same inode: not read again
    assert "step-00000002/__0_1.distcp" in read and "step-00000002/.metadata" in read
    derive(t1, 2, 3, changed=set(), linked=frozenset({"__0_0.distcp"}))
    frozen = t1 / layout.step_dirname(3) / "__0_0.distcp"
    st = frozen.stat()
    os.utime(frozen, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # as a write would
    _upload(t1, remote, 3)
    assert "step-00000003/__0_0.distcp" in read  # the mtime moved: read again
    shutil.rmtree(t1 / layout.step_dirname(1))
    _restores_from_tier2_alone(remote, t1, tmp_path / "fresh", 2)
