"""Tier2Catalog: the one reader of tier-2 state, on a real file:// store."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._synthetic import make_checkpoint
from tierckpt.errors import IntegrityError, ObjectNotFoundError
from tierckpt.format import layout
from tierckpt.tier1 import manifests as t1
from tierckpt.tier2 import catalog as t2
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage, MemoryStorage

FILES = {"__0_0.distcp": (500, 0)}


def _upload(root: Path, store: LocalStorage | MemoryStorage, step: int) -> None:
    make_checkpoint(root, step, FILES)
    d = root / layout.step_dirname(step)
    for name in ("__0_0.distcp", layout.MANIFEST, layout.COMPLETE):
        store.put_bytes(Tier2Catalog.key(step, name), (d / name).read_bytes())


def test_listing_and_verified_reads(tmp_path: Path) -> None:
    (tmp_path / "t2").mkdir()  # a file:// tier 2 must exist: opening one never creates it
    store = LocalStorage(tmp_path / "t2")
    for s in (3, 1, 5):
        _upload(tmp_path / "t1", store, s)
    store.put_bytes("step-00000007/__0_0.distcp", b"partial")  # no marker
    cat = Tier2Catalog(store)
    assert cat.complete_steps() == [1, 3, 5]
    assert set(cat.objects()) == {1, 3, 5, 7} and cat.objects()[7] == {"__0_0.distcp": 7}
    assert cat.read_committed(3).manifest.step == 3
    assert cat.marker(3) == (tmp_path / "t1" / "step-00000003" / "COMPLETE").read_bytes()
    assert cat.marker(7) is None
    with pytest.raises(ObjectNotFoundError):
        cat.read_committed(7)


def test_renamed_and_oversized_are_refused(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStorage()
    _upload(tmp_path, store, 2)
    for name in (layout.MANIFEST, layout.COMPLETE):  # a copy under another step's name
        store.put_bytes(Tier2Catalog.key(8, name), store.get_bytes(Tier2Catalog.key(2, name)))
    cat = Tier2Catalog(store)
    with pytest.raises(IntegrityError, match="named for step 8"):
        cat.read_committed(8)
    monkeypatch.setattr(t2, "SMALL_FILE_LIMIT", 16)
    with pytest.raises(IntegrityError, match="COMPLETE is larger than 16 bytes"):
        cat.read_committed(2)
    monkeypatch.setattr(t2, "SMALL_FILE_LIMIT", 1 << 20)
    monkeypatch.setattr(t2, "MANIFEST_LIMIT", 16)
    with pytest.raises(IntegrityError, match=r"manifest\.json is larger than 16 bytes"):
        cat.read_committed(2)
    # one pair of bounds, shared by both tiers
    assert (t1.SMALL_FILE_LIMIT, t1.MANIFEST_LIMIT) == (64 << 20, 1 << 30)


def test_delete_removes_the_marker_first_and_retention_keeps_policy(tmp_path: Path) -> None:
    store = MemoryStorage()
    for s in (10, 20, 30, 40):
        _upload(tmp_path, store, s)
    order: list[str] = []
    real = store.delete
    store.delete = lambda key: (order.append(key), real(key))[1]  # type: ignore[method-assign]
    cat = Tier2Catalog(store)
    cat.delete(10)
    assert order[0] == "step-00000010/COMPLETE" and not cat.objects().get(10)
    assert cat.apply_retention(keep_last=1, keep_every=20) == [30]
    assert cat.complete_steps() == [20, 40]
