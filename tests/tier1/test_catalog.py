"""Tier1Catalog: the one reader of a tier-1 root, on real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._synthetic import make_checkpoint
from tierckpt.errors import IntegrityError, LockError, SignatureError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.tier1 import catalog as cat_mod
from tierckpt.tier1.catalog import UPLOAD_HOLDER, Tier1Catalog

FILES = {"__0_0.distcp": (1000, 0), ".metadata": (100, None)}


def test_complete_candidates_and_in_progress(tmp_path: Path) -> None:
    for s in (1, 3):
        make_checkpoint(tmp_path, s, FILES)
    (tmp_path / layout.step_dirname(5)).mkdir()  # final name, no marker
    (tmp_path / layout.tmp_dirname(7, "abc")).mkdir()
    (tmp_path / layout.deleting_dirname(0, "zz")).mkdir()
    cat = Tier1Catalog(tmp_path)
    assert cat.complete_steps() == [3, 1]
    assert cat.candidate_steps() == [5, 3, 1]
    assert [(s, p.name) for s, p in cat.in_progress()] == [(7, layout.tmp_dirname(7, "abc"))]
    assert Tier1Catalog(tmp_path / "missing").complete_steps() == []


def test_read_committed_verifies_marker_name_and_bound(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m = make_checkpoint(tmp_path, 4, FILES)
    cat = Tier1Catalog(tmp_path)
    got = cat.read_committed(4)
    assert got.manifest == m and got.marker_bytes == (cat.step_dir(4) / "COMPLETE").read_bytes()
    os.rename(cat.step_dir(4), cat.step_dir(9))
    with pytest.raises(IntegrityError, match="named for step 9 but its manifest is step 4"):
        cat.read_committed(9)
    monkeypatch.setattr(cat_mod, "MANIFEST_LIMIT", 10)
    with pytest.raises(IntegrityError, match=r"manifest\.json is larger than 10 bytes"):
        cat_mod.read_committed(cat.step_dir(9), step=None)
    (cat.step_dir(9) / layout.COMPLETE).unlink()
    with pytest.raises(IntegrityError, match="no COMPLETE marker"):
        cat.read_committed(9)


def test_a_manifest_over_the_small_file_bound_is_read(tmp_path: Path) -> None:
    """A manifest grows with ranks × tensors (386 MiB for a 70B state at 4,096 ranks): one
    past the 64 MiB bound of markers and records is still a checkpoint's manifest."""
    m = make_checkpoint(tmp_path, 4, FILES)
    d = Tier1Catalog(tmp_path).step_dir(4)
    big = m.to_bytes()[:-1] + b" " * (cat_mod.SMALL_FILE_LIMIT + 1) + b"\n"  # still its JSON
    (d / layout.MANIFEST).write_bytes(big)
    (d / layout.COMPLETE).unlink()
    (d / layout.COMPLETE).write_bytes(mf.marker_bytes(big, m.step, m.save_id))
    assert len(big) > cat_mod.SMALL_FILE_LIMIT
    assert cat_mod.read_committed(d, step=4).manifest == m


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
    intact = cat_mod.read_committed(d, step=4)
    p = d / layout.MANIFEST
    if damage == "flip":
        data = bytearray(p.read_bytes())
        data[len(data) // 3] ^= 0x04
        p.write_bytes(bytes(data))
    elif damage == "delete":
        p.unlink()
    else:
        os.truncate(p, 10)
    got = cat_mod.read_committed(d, step=4)
    assert got == intact and got.manifest == m
    assert "rebuilt from its manifest parts" in caplog.text
    # a part damaged as well: nothing vouches for a rebuilt manifest, the first reason stands
    part = d / layout.part_filename(9)
    part.write_bytes(part.read_bytes().replace(b'"size":59', b'"size":58'))
    with pytest.raises(IntegrityError, match=r"manifest\.json|digest does not match"):
        cat_mod.read_committed(d, step=4)


def test_a_rebuild_is_refused_under_another_key(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _sealed(tmp_path, key=b"k1")
    d = Tier1Catalog(tmp_path).step_dir(4)
    (d / layout.MANIFEST).unlink()
    monkeypatch.setenv(mf.SIGNING_KEY_ENV, "k2")
    with pytest.raises(SignatureError):
        cat_mod.read_committed(d, step=4)


def test_a_domain_on_its_saved_layout_reads_only_its_parts(tmp_path: Path) -> None:
    m = _sealed(tmp_path)
    d = Tier1Catalog(tmp_path).step_dir(4)
    for name in ("manifest.00002.json", layout.MANIFEST):  # not needed by ranks 6..8
        (d / name).unlink()
    view = cat_mod.read_domain(d, step=4, domain=(6, 7, 8), world_size=20)
    assert view is not None and view.domains == m.domains and view.world_size == 20
    want = [f for f in m.files if f.rank in (6, 7, 8) or f.name in
            (".metadata", "manifest.00000.json", "manifest.00001.json")]
    assert sorted(view.files, key=lambda f: f.name) == sorted(want, key=lambda f: f.name)
    # not the saved layout: the caller reads the whole manifest
    assert cat_mod.read_domain(d, step=4, domain=(6, 7, 8), world_size=21) is None
    assert cat_mod.read_domain(d, step=4, domain=(6, 7), world_size=20) is None
    with pytest.raises(IntegrityError, match="renamed by hand"):
        cat_mod.read_domain(d, step=5, domain=(6, 7, 8), world_size=20)
    with pytest.raises(IntegrityError, match=r"manifest\.00002\.json but it is missing"):
        cat_mod.read_domain(d, step=4, domain=(15, 16, 17), world_size=20)
    part = d / "manifest.00001.json"
    part.write_bytes(part.read_bytes()[:-2] + b" \n")
    with pytest.raises(IntegrityError, match=r"digest does not match manifest\.00001\.json"):
        cat_mod.read_domain(d, step=4, domain=(6, 7, 8), world_size=20)


def test_parts_without_the_header_leave_the_domain_to_the_manifest(tmp_path: Path) -> None:
    """Checkpoints saved when parts carried no header (before the manifest could be rebuilt
    from them): the domain reads the whole manifest, as it did then."""
    m = make_checkpoint(tmp_path, 4, FILES, domains=((0,),), world_size=1)
    d = Tier1Catalog(tmp_path).step_dir(4)
    name = layout.part_filename(0)
    old = mf._canonical({"format_version": 1, "step": 4, "save_id": m.save_id,
                         "world_size": 1, "part": name,
                         "files": [f.to_json() for f in m.files]})
    (d / name).write_bytes(old)
    (d / layout.COMPLETE).unlink()
    (d / layout.COMPLETE).write_bytes(mf.marker_bytes((d / layout.MANIFEST).read_bytes(), 4,
                                                      m.save_id, parts={name: old}))
    assert cat_mod.read_domain(d, step=4, domain=(0,), world_size=1) is None
    assert cat_mod.read_committed(d, step=4).manifest == m
    (d / layout.MANIFEST).unlink()  # and with no header nothing rebuilds a lost manifest
    with pytest.raises(IntegrityError, match=r"manifest\.json missing"):
        cat_mod.read_committed(d, step=4)


def test_pins_and_upload_records(tmp_path: Path) -> None:
    cat = Tier1Catalog(tmp_path)
    cat.pin(3, UPLOAD_HOLDER)
    cat.pin(3, "eval")
    cat.pin(5, UPLOAD_HOLDER)
    assert cat.pins() == {3: ["eval", UPLOAD_HOLDER], 5: [UPLOAD_HOLDER]}
    cat.unpin_all(UPLOAD_HOLDER)
    assert cat.pins() == {3: ["eval"]}
    assert not cat.has_upload_records() and cat.upload_records() == {}
    cat.write_upload_record(3, status="verified", save_id="a")
    cat.write_upload_record(4, status="failed", error="boom")
    (cat.upload_state_dir() / "step-00000009.json").write_text("{not json")
    assert cat.has_upload_records()
    assert cat.upload_record(4) is not None and cat.upload_record(4)["error"] == "boom"  # type: ignore[index]
    assert cat.upload_record(9) is None and set(cat.upload_records()) == {3, 4}
    assert cat.uploaded_steps() == {3}


def test_retention_plan_holds_what_the_uploader_still_needs(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        make_checkpoint(tmp_path, s, FILES)
    cat = Tier1Catalog(tmp_path)
    cat.pin(1, "eval")
    policy = RetentionPolicy(keep_last=1)
    assert cat.retention_plan(policy, uploader=False).delete == (2, 3)
    held = cat.retention_plan(policy, uploader=True)  # nothing uploaded yet: all held
    assert held.delete == () and held.kept[3] == "not yet on tier 2"
    cat.write_upload_record(3, status="verified")
    plan = cat.retention_plan(policy, uploader=True)
    assert plan.delete == (2, 3) and plan.kept == {4: "newest", 1: "pinned"}


def test_quarantine_keeps_the_entry_and_its_reason(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 2, FILES)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / layout.step_dirname(6))
    cat = Tier1Catalog(tmp_path)
    moved = cat.quarantine(2, "flipped byte")
    link = cat.quarantine(6, "a symlink")
    assert not cat.step_dir(2).exists() and (moved / "__0_0.distcp").is_file()
    assert list(elsewhere.iterdir()) == []  # a symlink is moved, never followed
    assert link.is_symlink()
    assert [(q.path.name, q.reason) for q in cat.quarantined()] == [
        (moved.name, "flipped byte"), (link.name, "a symlink")]


def test_stale_cleanup_and_two_phase_delete(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 1, FILES)
    make_checkpoint(tmp_path, 2, FILES)
    (tmp_path / layout.tmp_dirname(3, "x")).mkdir()
    cat = Tier1Catalog(tmp_path)
    gone = cat.unpublish(1)
    assert cat.complete_steps() == [2] and gone.is_dir()
    assert sorted(p.name for p in cat.stale_entries()) == sorted(
        [gone.name, layout.tmp_dirname(3, "x")])
    assert len(cat.clean_stale()) == 2 and cat.stale_entries() == []
    cat.delete(2)
    assert cat.complete_steps() == [] and os.listdir(tmp_path) == []


def test_locks_refuse_a_second_holder(tmp_path: Path) -> None:
    cat = Tier1Catalog(tmp_path)
    job, up = cat.lock(), cat.uploader_lock()
    try:
        with pytest.raises(LockError, match="another job is writing checkpoints"):
            cat.lock()
        with pytest.raises(LockError, match="another uploader is running"):
            Tier1Catalog(tmp_path).uploader_lock()
    finally:
        job.release()
        up.release()
    cat.lock().release()  # free again


def test_the_job_policy_round_trips_and_is_not_an_upload_record(tmp_path: Path) -> None:
    cat = Tier1Catalog(tmp_path)
    assert cat.recorded_policy() is None  # no job with a tier 2 ever started here
    policy = RetentionPolicy(keep_last=4, upload_every=10, tier2_keep_last=2,
                             tier2_keep_every=1000)
    path = cat.write_policy(tier2="s3://bucket/run", policy=policy, file_mode=0o600)
    assert path == tmp_path / layout.UPLOAD_STATE / layout.JOB_POLICY
    assert os.stat(path).st_mode & 0o777 == 0o600
    rec = cat.recorded_policy()
    assert rec is not None and rec.tier2 == "s3://bucket/run" and rec.policy == policy
    assert rec.path == path
    assert cat.upload_records() == {} and cat.has_upload_records()
    cat.write_policy(tier2="s3://bucket/run", policy=RetentionPolicy())  # a later job
    assert Tier1Catalog(tmp_path).recorded_policy().policy == RetentionPolicy()  # type: ignore[union-attr]


@pytest.mark.parametrize("body", [b"{not json", b"[]", b'{"tier2": "s3://b/p"}',
                                  b'{"tier2": "s3://b/p", "keep_last": 0, "upload_every": 1, '
                                  b'"tier2_keep_last": 3, "tier2_keep_every": 0}'])
def test_a_damaged_job_policy_is_an_integrity_error_naming_it(tmp_path: Path,
                                                              body: bytes) -> None:
    cat = Tier1Catalog(tmp_path)
    cat.policy_path().parent.mkdir()
    cat.policy_path().write_bytes(body)
    with pytest.raises(IntegrityError, match=layout.JOB_POLICY):
        cat.recorded_policy()
