"""Choosing the restore point in the field: after a restore from an older step the run can
save again, and a tier 2 that is down or hung never blocks a restore from tier 1."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt import Tier2
from tierckpt.errors import (
    BadDigestError,
    ConfigError,
    ObjectNotFoundError,
    SignatureError,
    Tier2OutageError,
)
from tierckpt.format import layout
from tierckpt.restore.choose import Chooser
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage


def _state(seed: int = 0) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    m = nn.Linear(32, 32)
    return tierckpt.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _save(root: Path, steps: list[int]) -> None:
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=10) as ck:
        for s in steps:
            with torch.no_grad():
                st.model.weight.add_(1.0)
            ck.save(s, st).wait()


def _truncate_shard(d: Path) -> None:
    p = max(d.glob("*.distcp"), key=lambda q: q.stat().st_size)
    os.truncate(p, p.stat().st_size // 2)


def test_saving_after_resuming_from_an_older_checkpoint(tmp_path: Path) -> None:
    """The README loop after the newest checkpoint was damaged: restore 19, save 29 again."""
    _save(tmp_path, [9, 19, 29])
    _truncate_shard(tmp_path / layout.step_dirname(29))
    st = _state(1)
    with tierckpt.CheckpointManager(tier1=tmp_path, keep_last=10) as ck:
        info = ck.restore(st)
        assert info is not None and info.step == 19
        ck.save(29, st).wait()  # raised "step 29 is already committed" before the fix
    with tierckpt.CheckpointManager(tier1=tmp_path, keep_last=10) as ck:
        again = ck.restore(_state(2))
    assert again is not None and again.step == 29 and again.skipped == ()


def test_newer_steps_are_set_aside_with_the_reason(tmp_path: Path) -> None:
    """Every entry above the restore point leaves the root with its reason — here a
    partial commit (no marker) and a damaged step; a step committed on one node only is
    in tests/test_multinode.py — and those steps can be saved again."""
    _save(tmp_path, [1, 2, 3])
    (tmp_path / layout.step_dirname(2) / layout.COMPLETE).unlink()  # 2: a partial commit
    _truncate_shard(tmp_path / layout.step_dirname(3))
    with tierckpt.CheckpointManager(tier1=tmp_path, keep_last=10) as ck:
        info = ck.restore(_state())
        assert info is not None and info.step == 1
        ck.save(2, _state()).wait()
    reasons = {q.path.name.split(".")[0]: q.reason for q in Tier1Catalog(tmp_path).quarantined()}
    assert set(reasons) == {"step-00000002", "step-00000003"}
    assert Tier1Catalog(tmp_path).complete_steps() == [2, 1]


class Blackhole:
    """A loopback TCP server that accepts connections and never answers: a hung tier 2."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def hung_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    hole = Blackhole()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{hole.port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    try:
        yield "s3://bucket/run"
    finally:
        hole.close()


def test_hung_tier2_does_not_block_a_restore_from_tier1(tmp_path: Path, hung_s3: str) -> None:
    _save(tmp_path, [4, 8])
    t0 = time.monotonic()
    with tierckpt.CheckpointManager(
            tier1=tmp_path, tier2=Tier2(hung_s3, start_uploader=False, timeout_s=1.5)) as ck:
        info = ck.restore(_state())
    took = time.monotonic() - t0
    assert info is not None and info.step == 8 and info.source == "tier1"
    assert took < 60, took  # bounded by the deadline, not by S3 retries (minutes) or forever
    (ev,) = [e for e in events.read_events(tmp_path / layout.EVENTS)
             if e["event"] == events.TIER2_UNAVAILABLE]
    assert "no answer within 1.5 s" in ev["reason"]


def test_unreachable_tier2_with_empty_tier1_is_not_a_fresh_start(tmp_path: Path,
                                                                 hung_s3: str) -> None:
    with tierckpt.CheckpointManager(
            tier1=tmp_path, tier2=Tier2(hung_s3, start_uploader=False, timeout_s=1.0,
                                        outage_wait_s=0)) as ck, \
            pytest.raises(Tier2OutageError, match="refusing to start training from scratch"):
        ck.restore(_state())


def test_a_tier2_that_can_never_work_is_refused_when_the_job_starts(tmp_path: Path) -> None:
    """A file:// tier 2 that is not a directory is a configuration error at construction
    (an outage, above, is only a warning): the job is told before it trains for hours."""
    _save(tmp_path / "t1", [3])
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        tierckpt.CheckpointManager(tier1=tmp_path / "t1",
                                   tier2=Tier2(bad.as_uri(), start_uploader=False))
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1") as ck:  # the root was released
        info = ck.restore(_state())
    assert info is not None and info.step == 3


def test_a_tier2_mount_that_is_down_does_not_stop_a_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file:// tier 2 whose directory is missing (an NFS mount that is down) is an outage,
    not a configuration error: the job restarts from tier 1 and says so (the chaos drill
    found the crash loop); the directory is never created."""
    _save(tmp_path / "t1", [3])
    gone = tmp_path / "mnt" / "tier2"
    with caplog.at_level(logging.WARNING, logger="tierckpt"), tierckpt.CheckpointManager(
            tier1=tmp_path / "t1", tier2=Tier2(gone.as_uri(), drain_s=0)) as ck:
        info = ck.restore(_state())
    assert info is not None and info.step == 3 and info.source == "tier1"
    assert any("is not there" in r.getMessage() for r in caplog.records)
    assert not gone.exists()


def test_a_failed_fetch_is_damage_only_when_tier2_answers_for_the_step(tmp_path: Path) -> None:
    """``Chooser.damaged_on_tier2``: a CRC32C mismatch is damage; a missing object is
    damage while the step's marker is on tier 2, and not when it is gone too (tier 2 away,
    or the step deleted meanwhile: try again later); a signature failure never is."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    remote = Tier2Catalog(open_storage(bucket.as_uri()))
    remote.storage.put_bytes("step-00000002/COMPLETE", b"{}")
    log = events.EventLog(tmp_path / "events.jsonl")
    with Chooser(Tier1Catalog(tmp_path / "t1"), Comm(), (0,), is_owner=True, full=False,
                 log=log, open_remote=lambda: remote) as chooser:
        chooser.remote = remote
        missing = ObjectNotFoundError("get objects/sha256/ab: no such object")
        assert chooser.damaged_on_tier2(2, BadDigestError("crc32c mismatch"))
        assert chooser.damaged_on_tier2(2, missing)
        assert not chooser.damaged_on_tier2(3, missing)  # no marker of step 3
        assert not chooser.damaged_on_tier2(2, SignatureError("bad HMAC"))
        assert not chooser.damaged_on_tier2(2, OSError("connection reset"))
