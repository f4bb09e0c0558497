"""The run users care about, on Azure Blob Storage (Azurite): train and save with an az://
tier 2, wipe tier 1 (the node is gone), resume from tier 2 alone — bit-identical losses.
The S3 twin is tests/test_tier2_servers.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from azureserver import AzureEnv
from torch import nn

import tierckpt
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog


def _state(seed: int = 0) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.1), nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierckpt.TrainState(model=model, optimizer=opt, extra={"seen": 0})


def _train(st: tierckpt.TrainState, steps: range) -> list[float]:
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 256, generator=g)
        loss = st.model(x).pow(2).mean()
        st.optimizer.zero_grad()
        loss.backward()
        st.optimizer.step()
        st.extra["seen"] += 16
        out.append(loss.item())
    return out


def test_resume_from_azure_tier2_only(tmp_path: Path, azure_env: AzureEnv) -> None:
    """Through the whole job: the probe (md5 integrity, create-only marker), the uploader
    process finding the emulator through AZURE_STORAGE_CONNECTION_STRING, the drain on
    close, the fetch from tier 2 verified against the manifest."""
    root = tmp_path / "t1"
    reference = _train(_state(), range(0, 10))
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, tier2=azure_env.url, keep_last=2) as ck:
        assert _train(st, range(0, 5)) == reference[:5]
        ck.save(4, st).wait()  # close() drains the upload
    assert Tier1Catalog(root).uploads.upload_record(4)["integrity"] == "md5"  # type: ignore[index]
    assert azure_env.keys().count("step-00000004/COMPLETE") == 1  # the marker, once
    shutil.rmtree(root)  # the node is gone: tier 2 alone
    st2 = _state(seed=99)
    with tierckpt.CheckpointManager(tier1=root, tier2=azure_env.url) as ck:
        info = ck.restore(st2)
        assert info is not None and (info.step, info.source) == (4, "tier2")
        assert st2.extra["seen"] == 5 * 16
        assert _train(st2, range(5, 10)) == reference[5:]  # bit-identical
    assert any(e["event"] == events.RESTORE_DONE for e in events.read_events(root / layout.EVENTS))
