"""One bounded wait per outage (tier2/link.py with the manager): a tier 2 that does not
answer the start-up probe costs the probe's ``timeout_s`` once. The restore does not wait on
it again, and ``close()`` does not spend ``drain_s`` on it; it names what stays on tier 1.

Two servers: a black hole (accepts, never answers) and a slow one (the fault proxy in front
of SeaweedFS answers every request ``hang_s`` late, after the timeout). Times are only
loose upper bounds against a hang (the drain default is 600 s); what each phase did is read
from the events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import tierckpt
from tests.restore.test_choose import Blackhole
from tierckpt import Tier2
from tierckpt.format import layout
from tierckpt.runtime import events

if TYPE_CHECKING:
    from s3server import S3Env

TIMEOUT_S = 2.0


def _state() -> tierckpt.TrainState:
    torch.manual_seed(0)
    m = nn.Linear(32, 32)
    return tierckpt.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _kinds(root: Path, kind: str) -> list[dict]:
    return [e for e in events.read_events(root / layout.EVENTS) if e["event"] == kind]


@pytest.fixture
def black_hole(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    hole = Blackhole()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{hole.port}")
    for k, v in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    try:
        yield "s3://bucket/run"
    finally:
        hole.close()


def _start_restore_save_close(root: Path, url: str) -> dict[str, float]:
    """A restart during the outage: open, restore, one save, a clean close (default drain
    600 s). Returns each phase's seconds."""
    st, t = _state(), {"t0": time.monotonic()}
    ck = tierckpt.CheckpointManager(tier1=root, tier2=Tier2(url, timeout_s=TIMEOUT_S))
    t["opened"] = time.monotonic()
    info = ck.restore(st)
    t["restored"] = time.monotonic()
    assert info is not None and info.step == 5 and info.source == "tier1"
    ck.save(6, st).wait(60)
    t["saved"] = time.monotonic()
    ck.close()
    t["closed"] = time.monotonic()
    return {"open": t["opened"] - t["t0"], "restore": t["restored"] - t["opened"],
            "close": t["closed"] - t["saved"]}


def _check(root: Path, took: dict[str, float]) -> None:
    (unavailable,) = _kinds(root, events.TIER2_UNAVAILABLE)
    assert "did not answer the start-up probe" in unavailable["reason"]
    assert "not asked again" in unavailable["reason"]
    (drained,) = _kinds(root, events.UPLOAD_DRAINED)
    assert drained["seconds"] == 0 and 6 in drained["left"], drained
    assert "has not answered since this job started" in drained["why"]
    # against a hang, not a speed claim: one probe timeout, no second wait, no drain
    assert took["restore"] < 10 * TIMEOUT_S and took["close"] < 60, took


@pytest.mark.slow
def test_a_black_hole_tier2_costs_one_timeout_per_start(tmp_path: Path, black_hole: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "t1"
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(5, _state()).wait(60)
    took = _start_restore_save_close(root, black_hole)
    _check(root, took)
    left = [r.getMessage() for r in caplog.records if "on tier 1 only" in r.getMessage()]
    assert left and "[5, 6]" in left[0] and "safe there" in left[0], left


@pytest.mark.slow
def test_a_slow_tier2_is_waited_for_once(tmp_path: Path, s3_env: S3Env,
                                         fault_proxy: Any) -> None:
    root = tmp_path / "t1"
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(5, _state()).wait(60)
    fault_proxy.add_rule("delay", hang_s=3 * TIMEOUT_S, times=None)  # answers, but late
    took = _start_restore_save_close(root, s3_env.url)
    _check(root, took)
