"""A job on a minimal S3 server (tier2/link.py with the manager): SeaweedFS behind the fault
proxy, which answers ``501 NotImplemented`` to the multipart calls such a server lacks —
listing and aborting multipart uploads (s3rver, localbucket), or multipart altogether.

A 501 on an optional call is a capability, not an outage: the start-up probe does not say
"did not answer", the uploader sends every object in one PUT (the shard here is above the
16 MiB multipart threshold) and never asks for the stale-upload sweep, it is never
restarted, and every checkpoint reaches tier 2 verified and loads from there."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from faultproxy import NO_MULTIPART, NO_MULTIPART_LISTING
from torch import nn

import tierckpt
from tierckpt import Tier2
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

if TYPE_CHECKING:
    from s3server import S3Env

MINIMAL = {"no-multipart-listing": NO_MULTIPART_LISTING, "no-multipart": NO_MULTIPART}
STEPS = (1, 2, 3)


def _state() -> tierckpt.TrainState:
    torch.manual_seed(0)
    m = nn.Linear(2048, 2200, bias=False)  # 17.2 MiB: above the 16 MiB multipart threshold
    return tierckpt.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _wait_verified(root: Path, step: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (Tier1Catalog(root).uploads.upload_record(step) or {}).get("status") != "verified":
        assert time.monotonic() < deadline, Tier1Catalog(root).uploads.upload_record(step)
        time.sleep(0.05)


def _kinds(root: Path, kind: str) -> list[dict]:
    return [e for e in events.read_events(root / layout.EVENTS) if e["event"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("server", sorted(MINIMAL))
def test_a_minimal_server_gets_every_checkpoint_in_single_puts(
        server: str, tmp_path: Path, s3_env: S3Env, fault_proxy: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    fault_proxy.not_implemented(MINIMAL[server])
    root, st = tmp_path / "t1", _state()
    with caplog.at_level(logging.WARNING, logger="tierckpt"), tierckpt.CheckpointManager(
            tier1=root, tier2=Tier2(s3_env.url, drain_s=120)) as ck:
        after_probe = len(fault_proxy.hits)
        for step in STEPS:
            ck.save(step, st).wait(60)
            _wait_verified(root, step)  # each step on its own (the newest wins otherwise)
    assert not [m for m in caplog.messages if "did not answer" in m], caplog.messages
    assert any("every object goes in one PUT" in m for m in caplog.messages)  # said at start
    assert not _kinds(root, events.UPLOADER_RESTARTED)  # no crash loop
    assert not _kinds(root, events.UPLOAD_FAILED)
    assert {e["step"] for e in _kinds(root, events.UPLOAD_VERIFIED)} == set(STEPS)
    ledger = Tier1Catalog(root).uploads
    assert {s: (ledger.upload_record(s) or {}).get("status") for s in STEPS} == {
        s: "verified" for s in STEPS}
    assert Tier1Catalog(root).tier2_probe()["upload"] == "single-put"  # what ls shows

    uploads = fault_proxy.hits[after_probe:]
    multipart = [h for h in uploads if "upload" in h.query]
    assert multipart == [], multipart  # no part, no listing, no abort: single PUTs only
    assert [h for h in uploads if h.method == "PUT"]

    with open_storage(s3_env.url) as storage:
        remote = Tier2Catalog(storage)
        assert remote.complete_steps() == list(STEPS)
        assert max(o.size for o in storage.list("objects/")) > 16 * 2**20  # the shard's content
    keys = s3_env.keys()
    assert all(f"{layout.step_dirname(s)}/{layout.COMPLETE}" in keys for s in STEPS)
    assert s3_env.pending_uploads() == []
    fresh = nn.Linear(2048, 2200, bias=False)
    tierckpt.load(s3_env.url, fresh, step=3)
    assert torch.equal(fresh.weight, st.model.weight)  # type: ignore[union-attr]
