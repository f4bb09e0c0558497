"""Two fine-tunes of one base under one tier-2 prefix (``Tier2(url + "?run=NAME")``,
docs/staging.md "Sibling runs"): the second run's first upload sends its adapters and
optimizer, not the base the first run uploaded; deleting the first run from tier 2 leaves
the second whole, and it resumes from tier 2 alone, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import tierckpt
from tests.save.test_incremental import _state, _train
from tierckpt import Tier2, Writes
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

pytestmark = pytest.mark.slow


def _fine_tune(root: Path, url: str, st: tierckpt.TrainState, first: int) -> list[dict]:
    """Three saves (steps first, first+1, first+2), each after a step; the uploads."""
    with tierckpt.CheckpointManager(tier1=root, tier2=Tier2(url, keep_last=5),
                                    writes=Writes(incremental=True)) as ck:
        for step in range(first, first + 3):
            _train(st, range(step, step + 1))
            ck.save(step, st)
    return [e for e in events.read_events(root / layout.EVENTS)
            if e["event"] == "upload_verified"]


def test_a_sibling_run_uploads_what_differs_and_outlives_the_first(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url_a, url_b = f"{bucket.as_uri()}?run=lora-a", f"{bucket.as_uri()}?run=lora-b"
    a, b = _state(seed=0), _state(seed=0)  # one base; b's adapters train on other batches
    full = _fine_tune(tmp_path / "a", url_a, a, first=0)
    full.sort(key=lambda e: e["t"])
    sibling = _fine_tune(tmp_path / "b", url_b, b, first=100)
    base = sum(p.numel() * 4 for p in b.model.base.parameters())
    assert full[0]["bytes"] > base  # a's first upload sent the base
    first = min(sibling, key=lambda e: e["t"])  # b's first (the uploader may skip ahead)
    assert first["bytes"] < first["referenced"] - base, first  # the base not sent again
    assert (bucket / "runs" / "lora-a").is_dir() and (bucket / "objects" / "sha256").is_dir()
    with open_storage(url_a) as st:  # the first run deleted from tier 2, as gc would
        cat = Tier2Catalog(st)
        for step in cat.complete_steps():
            cat.delete(step)
        assert cat.complete_steps() == []
    shutil.rmtree(tmp_path / "b")  # b's tier 1 lost: tier 2 alone
    again = _state(seed=5)
    with tierckpt.CheckpointManager(tier1=tmp_path / "b2", tier2=Tier2(url_b)) as ck:
        info = ck.restore(again)
    assert info is not None and info.step == 102
    for x, y in zip(b.model.state_dict().values(), again.model.state_dict().values(),
                    strict=True):
        assert torch.equal(x, y)
    assert _train(again, range(103, 106)) == _train(b, range(103, 106))
