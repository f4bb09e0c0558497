"""The manager and a tier 2 that stops accepting writes mid-job (real SeaweedFS behind the
fault proxy, which answers 403 AccessDenied to everything once the job runs: credentials
revoked): the failure reaches the training process, tier 1 stays bounded, and with
tier2_required the save fails. Refused credentials at start are a ConfigError."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt import Tier2
from tierckpt.errors import ConfigError, SaveError
from tierckpt.format import layout
from tierckpt.ops.inventory import inventory
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog

if TYPE_CHECKING:
    from s3server import S3Env


def _state() -> tierckpt.TrainState:
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    return tierckpt.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _wait_for_failed_record(root: Path, step: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (Tier1Catalog(root).uploads.upload_record(step) or {}).get("status") != "failed":
        assert time.monotonic() < deadline, f"the uploader recorded no failure for {step}"
        time.sleep(0.05)


def _kinds(root: Path, kind: str) -> list[dict]:
    return [e for e in events.read_events(root / layout.EVENTS) if e["event"] == kind]


def _revoke(proxy: Any) -> None:
    proxy.add_rule("status", status=403, code="AccessDenied", times=None)


@pytest.mark.slow
def test_revoked_credentials_are_loud_and_tier1_stays_bounded(
        tmp_path: Path, s3_env: S3Env, fault_proxy: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    root, st = tmp_path / "t1", _state()
    with caplog.at_level(logging.WARNING, logger="tierckpt"), tierckpt.CheckpointManager(
            tier1=root, tier2=Tier2(s3_env.url, backlog=1, drain_s=2), keep_last=1) as ck:
        _revoke(fault_proxy)
        ck.save(0, st).wait()
        _wait_for_failed_record(root, 0)
        for step in range(1, 6):
            ck.save(step, st).wait()
            assert len(Tier1Catalog(root).complete_steps()) <= 1 + 1 + 1  # keep, backlog, pin
    unhealthy = _kinds(root, events.TIER2_UNHEALTHY)
    assert unhealthy and "403" in unhealthy[0]["error"]
    assert any("is failing" in r.getMessage() for r in caplog.records)
    skipped = [e["step"] for e in _kinds(root, events.UPLOAD_SKIPPED)]
    assert skipped and set(skipped) <= set(range(4))
    assert {e.step for e in inventory(root) if e.tier == 1} == {4, 5}  # bounded: keep + 1
    left = _kinds(root, events.UPLOAD_DRAINED)[-1]["left"]
    assert 5 in left  # named as left on tier 1 only


def test_tier2_required_turns_a_failing_tier2_into_a_save_error(
        tmp_path: Path, s3_env: S3Env, fault_proxy: Any) -> None:
    root, st = tmp_path / "t1", _state()
    with tierckpt.CheckpointManager(tier1=root,
                                    tier2=Tier2(s3_env.url, required=True, drain_s=0)) as ck:
        _revoke(fault_proxy)
        ck.save(0, st).wait()
        _wait_for_failed_record(root, 0)
        with pytest.raises(SaveError, match=r"Tier2\.required and .* tier 2 .* is failing"):
            ck.save(1, st)


def test_refused_credentials_at_start_are_a_config_error(
        tmp_path: Path, s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match="credentials refused"):
        tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier2=s3_env.url)


def test_a_missing_bucket_is_a_config_error(tmp_path: Path, s3_env: S3Env) -> None:
    with pytest.raises(ConfigError, match="bucket does not exist"):
        tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier2="s3://no-such-bucket-x/p")


def _only_on_tier2(tmp_path: Path) -> tuple[Path, Path]:
    """A run whose one checkpoint (step 5) is on a file:// tier 2, its tier 1 gone; the
    bucket moved away (an unmounted store). Returns (bucket, where it was moved)."""
    bucket, away = tmp_path / "bucket", tmp_path / "bucket.away"
    bucket.mkdir()
    with tierckpt.CheckpointManager(tier1=tmp_path / "gone", tier2=bucket.as_uri()) as ck:
        ck.save(5, _state())
    bucket.rename(away)
    return bucket, away


@pytest.mark.slow
def test_a_start_waits_out_a_tier2_outage_that_holds_the_only_copy(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bucket, away = _only_on_tier2(tmp_path)
    back = threading.Timer(2.0, away.rename, args=(bucket,))  # the store comes back
    back.start()
    root = tmp_path / "wiped"
    try:
        with caplog.at_level(logging.WARNING, logger="tierckpt"), tierckpt.CheckpointManager(
                tier1=root, tier2=Tier2(bucket.as_uri(), outage_wait_s=60)) as ck:
            info = ck.restore(_state())
    finally:
        back.join()
    assert info is not None and (info.step, info.source) == (5, "tier2")
    [waited] = [e for e in _kinds(root, events.TIER2_UNAVAILABLE) if "retry_in_s" in e]
    assert waited["outage_wait_s"] == 60 and waited["retry_in_s"] > 0
    assert "holds the only copy" in caplog.text and "trying again" in caplog.text


def test_an_outage_past_outage_wait_s_is_a_clear_error(tmp_path: Path) -> None:
    bucket, _ = _only_on_tier2(tmp_path)
    with tierckpt.CheckpointManager(tier1=tmp_path / "wiped", tier2=Tier2(
            bucket.as_uri(), outage_wait_s=0)) as ck, pytest.raises(
            tierckpt.Tier2OutageError, match=r"outage_wait_s=0.*Run the job again"):
        ck.restore(_state())
