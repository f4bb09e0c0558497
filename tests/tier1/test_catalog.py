"""Tier1Catalog: the one reader of a tier-1 root, on real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._synthetic import make_checkpoint
from tierckpt.errors import IntegrityError, LockError
from tierckpt.format import layout
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.tier1.catalog import Tier1Catalog

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


def test_retention_plan_holds_what_the_uploader_still_needs(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        make_checkpoint(tmp_path, s, FILES)
    cat = Tier1Catalog(tmp_path)
    cat.pin(1, "eval")
    policy = RetentionPolicy(keep_last=1)
    assert cat.retention_plan(policy, uploader=False).delete == (2, 3)
    held = cat.retention_plan(policy, uploader=True)  # nothing uploaded yet: all held
    assert held.delete == () and held.kept[3] == "not yet on tier 2"
    cat.uploads.write_upload_record(3, status="verified")
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
    job, up = cat.lock(), cat.uploads.uploader_lock()
    try:
        with pytest.raises(LockError, match="another job is writing checkpoints"):
            cat.lock()
        with pytest.raises(LockError, match="another uploader is running"):
            Tier1Catalog(tmp_path).uploads.uploader_lock()
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
    assert cat.uploads.upload_records() == {} and cat.uploads.has_upload_records()
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
