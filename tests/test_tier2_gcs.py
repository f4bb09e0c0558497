"""A run on Google Cloud Storage (its emulator, fake-gcs-server): train and save with a
``gs://`` tier 2, lose the node (tier 1 wiped), resume from tier 2 alone — the losses after
the resume are bit-identical to an uninterrupted run's. The whole job path: the probe,
the uploader process (which finds the emulator through ``STORAGE_EMULATOR_HOST``), the
drain on close, the fetch verified against the manifest."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from gcsserver import GCSEnv
from torch import nn

import tierckpt
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage


def _state(seed: int = 0) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.1), nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierckpt.TrainState(model=model, optimizer=opt, extra={"seen": 0})


def _train(st: tierckpt.TrainState, steps: range) -> list[float]:
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        loss = st.model(torch.randn(16, 256, generator=g)).pow(2).mean()
        st.optimizer.zero_grad()
        loss.backward()
        st.optimizer.step()
        st.extra["seen"] += 16
        out.append(loss.item())
    return out


def test_resume_from_gcs_alone_is_bit_identical(tmp_path: Path, gcs_env: GCSEnv) -> None:
    root = tmp_path / "t1"
    reference = _train(_state(), range(0, 10))
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, tier2=gcs_env.url, keep_last=2) as ck:
        assert _train(st, range(0, 5)) == reference[:5]
        ck.save(4, st).wait()  # close() drains the upload
    record = Tier1Catalog(root).uploads.upload_record(4)
    # the probe's mode reached the job's uploader: the emulator ignores declared checksums
    assert record is not None and record["integrity"] == "md5"
    with open_storage(gcs_env.url) as remote:
        assert Tier2Catalog(remote).complete_steps() == [4]
    assert not [n for n in gcs_env.names() if ".tierckpt-tmp." in n]
    shutil.rmtree(root)  # the node is gone: tier 2 alone
    st2 = _state(seed=99)
    with tierckpt.CheckpointManager(tier1=root, tier2=gcs_env.url) as ck:
        info = ck.restore(st2)
        assert info is not None and info.step == 4 and info.source == "tier2"
        assert st2.extra["seen"] == 5 * 16
        assert _train(st2, range(5, 10)) == reference[5:]  # bit-identical
    assert any(e["event"] == events.RESTORE_DONE for e in events.read_events(root / layout.EVENTS))
