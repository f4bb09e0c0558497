"""UploaderSupervisor with a real uploader process: a dead uploader is noticed, reported
and restarted with back-off; failing uploads are reported once per interval; close()
drains what is due and names what it left."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tests._synthetic import make_checkpoint
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.uploader import UploaderConfig
from tierckpt.tier2.uploader.supervisor import FIRST_RESTART_S, UploaderSupervisor

FILES = {"__0_0.distcp": (4096, 0), ".metadata": (64, None)}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _kinds(root: Path, kind: str) -> list[dict]:
    return [e for e in events.read_events(root / layout.EVENTS) if e["event"] == kind]


def _wait_dead(sup: UploaderSupervisor) -> None:
    deadline = time.monotonic() + 60
    while sup._proc is not None and sup._proc.poll() is None:
        assert time.monotonic() < deadline, "the uploader did not exit"
        time.sleep(0.05)


def test_a_dying_uploader_is_reported_and_restarted_with_backoff(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t1, not_a_dir = tmp_path / "t1", tmp_path / "tier2-is-a-file"
    not_a_dir.write_text("x")  # every uploader start fails: a crash loop to supervise
    make_checkpoint(t1, 1, FILES)
    clock = Clock()
    with events.EventLog(t1 / layout.EVENTS) as log:
        sup = UploaderSupervisor(UploaderConfig(tier1=t1, tier2=not_a_dir.as_uri()),
                                 log=log, clock=clock).start()
        _wait_dead(sup)
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            h = sup.check()
            assert not h.alive and not h.healthy and "exited with status" in (h.error or "")
            assert h.due == (1,)
            sup.check()  # the same reason within the interval: not reported again
        assert len(_kinds(t1, events.TIER2_UNHEALTHY)) == 1
        assert sum("is failing" in r.getMessage() for r in caplog.records) == 1
        clock.now += FIRST_RESTART_S - 0.1
        sup.check()
        assert sup.restarts == 0  # not before the back-off
        clock.now += 0.2
        sup.check()
        assert sup.restarts == 1 and _kinds(t1, events.UPLOADER_RESTARTED)[0]["restarts"] == 1
        _wait_dead(sup)
        sup.check()  # died again: the next restart waits twice as long
        clock.now += FIRST_RESTART_S + 0.1
        sup.check()
        assert sup.restarts == 1
        clock.now += FIRST_RESTART_S
        sup.check()
        assert sup.restarts == 2
        assert sup.close(drain_s=5) == [1]  # nothing could be uploaded: named as left
    assert _kinds(t1, events.UPLOAD_DRAINED)[-1]["left"] == [1]


def test_a_failed_upload_makes_tier2_unhealthy_until_one_succeeds(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    t1.mkdir()
    cat = Tier1Catalog(t1)
    with events.EventLog(t1 / layout.EVENTS) as log:
        sup = UploaderSupervisor(UploaderConfig(tier1=t1, tier2=t2.as_uri()), log=log)
        cat.uploads.write_upload_record(1, status="verified")
        assert sup.health().healthy
        cat.uploads.write_upload_record(2, status="failed", error="StorageError: 403 AccessDenied")
        h = sup.health()
        assert not h.healthy and "step 2 failed: StorageError: 403" in (h.error or "")
        cat.uploads.write_upload_record(3, status="verified")
        assert sup.health().healthy


def test_close_drains_what_is_due(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    for s in (1, 2, 3):
        make_checkpoint(t1, s, FILES)
    with events.EventLog(t1 / layout.EVENTS) as log:
        sup = UploaderSupervisor(UploaderConfig(tier1=t1, tier2=t2.as_uri(), poll_s=30),
                                 log=log).start()
        assert sup.close(drain_s=120) == []
    assert (t2 / layout.step_dirname(3) / layout.COMPLETE).exists()
    assert _kinds(t1, events.UPLOAD_DRAINED)[-1]["left"] == []
