"""inventory: checkpoint states from values (classify), and reading hand-made tier-1 roots
and a file:// tier 2 (observe_*)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._synthetic import make_checkpoint
from tests.tier2.test_content import BASE, derive
from tierckpt.errors import ConfigError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.ops.inventory import (
    Observed,
    classify,
    inventory,
    observe_tier1,
    observe_tier2,
    tier0_root,
)
from tierckpt.runtime import events
from tierckpt.tier0.root import BASE_ENV, JOB_FILE, PEER_DIR, default_root
from tierckpt.tier1 import fs
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage
from tierckpt.tier2.uploader.transfer import upload_step

NOW = 1_000_000.0


def _obs(step: int, tier: int = 1, **kw: object) -> Observed:
    base: dict = {"tier": tier, "step": step, "name": layout.step_dirname(step),
                  "committed": True, "bytes": 100, "created_unix": NOW - 60, "save_id": "s"}
    return Observed(**{**base, **kw})


def _states(entries: list) -> dict[tuple[int, int], str]:
    return {(e.tier, e.step): e.state for e in entries}


def test_states_from_values() -> None:
    observed = [_obs(1), _obs(2), _obs(3), _obs(4), _obs(5), _obs(6),
                _obs(7, committed=False, created_unix=None),
                _obs(8, marker_error="digest mismatch"),
                _obs(2, tier=2), _obs(9, tier=2, committed=False, created_unix=None)]
    upload = {2: {"status": "verified", "save_id": "s"},
              3: {"status": "uploading", "save_id": "s"},
              4: {"status": "failed", "error": "StorageError: 503"},
              5: {"status": "files_verified", "save_id": "s"},
              6: {"status": "conflict", "error": "different", "save_id": "s"},
              1: {"status": "verified", "save_id": "older-save"}}  # a previous step-1
    entries = classify(observed, upload=upload, pins={3: ["upload"], 2: ["b", "a"]}, now=NOW)
    assert _states(entries) == {
        (1, 1): "complete", (1, 2): "verified", (1, 3): "uploading", (1, 4): "upload_failed",
        (1, 5): "uploading", (1, 6): "conflict", (1, 7): "partial", (1, 8): "invalid",
        (2, 2): "verified", (2, 9): "partial"}
    by = {(e.tier, e.step): e for e in entries}
    assert by[1, 4].detail == "StorageError: 503" and by[1, 4].upload_status == "failed"
    assert "other nodes" in (by[1, 5].detail or "")
    assert by[1, 8].detail == "digest mismatch"
    assert by[1, 1].upload_status is None  # the record was about another checkpoint
    assert by[1, 2].pinned_by == ("a", "b") and by[1, 3].pinned_by == ("upload",)
    assert by[2, 2].pinned_by == ()  # pins are a tier-1 thing
    assert by[1, 1].age_s == 60.0 and by[2, 9].age_s is None
    assert [(e.step, e.tier) for e in entries][:4] == [(9, 2), (8, 1), (7, 1), (6, 1)]
    assert [(e.step, e.tier) for e in entries if e.step == 2] == [(2, 1), (2, 2)]


def test_age_is_never_negative_and_json_row() -> None:
    [e] = classify([_obs(1, created_unix=NOW + 5)], upload={}, pins={}, now=NOW)
    assert e.age_s == 0.0
    assert e.to_json() == {"tier": 1, "step": 1, "name": "step-00000001", "state": "complete",
                           "bytes": 100, "age_s": 0.0, "pinned_by": [], "upload_status": None,
                           "detail": None, "integrity": None, "uploaded_bytes": None}


def _commit(root: Path, step: int, *, payload: bytes = b"abc", manifest_step: int | None = None
            ) -> None:
    d = root / layout.step_dirname(step)
    d.mkdir(parents=True)
    fs.write_durably(d / "__0_0.distcp", payload)
    m = mf.Manifest(step=step if manifest_step is None else manifest_step, world_size=1,
                    save_id=f"s{step}", created_unix=NOW,
                    files=(mf.FileEntry(name="__0_0.distcp", size=len(payload),
                                        crc32c=checksum.extend(0, payload), rank=0),))
    mb = m.to_bytes()
    fs.write_durably(d / layout.MANIFEST, mb)
    fs.write_durably(d / layout.COMPLETE, mf.marker_bytes(mb, m.step, m.save_id))


def test_observe_tier1_reads_markers_not_shards(tmp_path: Path) -> None:
    _commit(tmp_path, 1)
    _commit(tmp_path, 2, manifest_step=7)  # renamed by hand
    _commit(tmp_path, 3)
    (tmp_path / "step-00000003" / layout.COMPLETE).write_bytes(b"garbage")
    (tmp_path / "step-00000004").mkdir()  # committed name, no marker yet
    (tmp_path / layout.tmp_dirname(5, "x")).mkdir()
    (tmp_path / layout.deleting_dirname(0, "y")).mkdir()  # being deleted: not listed
    (tmp_path / layout.QUARANTINE).mkdir()
    (tmp_path / layout.PINS).mkdir()
    (tmp_path / layout.PINS / layout.pin_filename(1, "upload")).touch()
    got = {o.name: o for o in observe_tier1(tmp_path)}
    assert set(got) == {"step-00000001", "step-00000002", "step-00000003", "step-00000004",
                        "step-00000005.tmp-x"}
    assert got["step-00000001"].marker_error is None
    assert got["step-00000001"].created_unix == NOW and got["step-00000001"].save_id == "s1"
    assert "step 7" in (got["step-00000002"].marker_error or "")
    assert "malformed" in (got["step-00000003"].marker_error or "")
    assert not got["step-00000004"].committed and not got["step-00000005.tmp-x"].committed
    assert Tier1Catalog(tmp_path).pins() == {1: ["upload"]}
    states = {e.name: e.state for e in inventory(tmp_path, now=NOW + 1)}
    assert states == {"step-00000001": "complete", "step-00000002": "invalid",
                      "step-00000003": "invalid", "step-00000004": "partial",
                      "step-00000005.tmp-x": "partial"}


def test_observe_tier2_partial_and_damaged_marker(tmp_path: Path) -> None:
    t1 = tmp_path / "t1"
    t1.mkdir()
    (tmp_path / "t2").mkdir()  # a file:// tier 2 must exist: opening one never creates it
    st = LocalStorage(tmp_path / "t2")
    st.put_bytes("step-00000001/__0_0.distcp", b"12345")
    st.put_bytes("step-00000002/COMPLETE", b"{}")
    entries = inventory(t1, st, now=NOW)
    by = {e.step: e for e in entries}
    assert (by[1].tier, by[1].state, by[1].bytes) == (2, "partial", 5)
    assert by[2].state == "invalid" and "manifest.json missing" in (by[2].detail or "")


def _tier0_root(root: Path, tier1: Path) -> Path:
    root.mkdir(parents=True)
    (root / JOB_FILE).write_text(json.dumps({"tier1": str(tier1)}))
    return root


def test_tier0_is_listed_where_this_node_holds_the_jobs_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RAM held step 29 while tier 1 held 24: ls must show both (the Tier0() root is
    derived from the tier-1 root; a Tier0(path) root is named)."""
    monkeypatch.setenv(BASE_ENV, str(tmp_path / "shm"))
    t1 = tmp_path / "t1"
    _commit(t1, 24)
    assert tier0_root(t1) is None and {e.tier for e in inventory(t1, now=NOW)} == {1}
    ram = _tier0_root(default_root(t1.absolute()), t1.absolute())
    _commit(ram, 29)
    _commit(ram / PEER_DIR, 28)
    (ram / layout.tmp_dirname(30, "x")).mkdir()
    rows = {(e.tier, e.name): e for e in inventory(t1, now=NOW + 1)}
    assert {k: e.state for k, e in rows.items()} == {
        (0, "step-00000029"): "complete", (0, "peer/step-00000028"): "complete",
        (0, "step-00000030.tmp-x"): "partial", (1, "step-00000024"): "complete"}
    assert "partner" in (rows[0, "peer/step-00000028"].detail or "")
    assert [(e.step, e.tier) for e in inventory(t1, now=NOW)][:2] == [(30, 0), (29, 0)]
    # a named Tier0(path) root, and one that belongs to another job
    named = _tier0_root(tmp_path / "mine", t1.absolute())
    _commit(named, 31)
    assert tier0_root(t1, named) == named
    assert {(e.tier, e.step) for e in inventory(t1, tier0=named, now=NOW)} == {(0, 31), (1, 24)}
    other = _tier0_root(tmp_path / "theirs", tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="belongs to another job"):
        tier0_root(t1, other)
    with pytest.raises(ConfigError, match="not a directory on this node"):
        tier0_root(t1, tmp_path / "absent")
    # the default root of another job (same key, another owner) is never read
    (ram / JOB_FILE).write_text(json.dumps({"tier1": "/somewhere/else"}))
    assert tier0_root(t1) is None


def test_tier2_rows_show_bytes_uploaded_beside_bytes_referenced(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"})
    log = events.EventLog(t1 / layout.EVENTS)
    for step in (1, 2):
        upload_step(Tier1Catalog(t1), Tier2Catalog(LocalStorage(t2)), step, log=log)
    rows = {o.step: o for o in observe_tier2(LocalStorage(t2))}
    for step in (1, 2):  # referenced: what the step holds, as its tier-1 copy
        d = t1 / layout.step_dirname(step)
        assert rows[step].bytes == sum(p.stat().st_size for p in d.iterdir())
    assert rows[1].uploaded == sum(s for s, _ in BASE.values())
    assert rows[2].uploaded == BASE["__0_1.distcp"][0]
