"""The run users care about, on any tier 2: train and save with it, lose the node (tier 1
wiped), resume from tier 2 alone, and the losses after the resume are bit-identical to an
uninterrupted run's. tests/test_tier2_servers.py (S3), test_tier2_gcs.py and
test_tier2_azure.py run it against their servers and check what each store keeps."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import tierckpt
from tierckpt.format import layout
from tierckpt.runtime import events


def tiny_state(seed: int = 0, width: int = 256) -> tierckpt.TrainState:
    """A two-layer model with dropout and AdamW, ``extra["seen"]`` counting samples."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.1), nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierckpt.TrainState(model=model, optimizer=opt, extra={"seen": 0})


def tiny_train(st: tierckpt.TrainState, steps: range, batch: int = 16) -> list[float]:
    """Train ``steps`` (each step's batch seeded by its number); the losses."""
    width = st.model[0].in_features  # type: ignore[index]
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        loss = st.model(torch.randn(batch, width, generator=g)).pow(2).mean()
        st.optimizer.zero_grad()
        loss.backward()
        st.optimizer.step()
        st.extra["seen"] += batch
        out.append(loss.item())
    return out


def resume_from_tier2_alone(root: Path, url: str, *, saved: int, end: int, width: int = 256,
                            batch: int = 16, uploaded: Callable[[], None] = lambda: None
                            ) -> None:
    """Train steps 0..``saved`` with tier 1 at ``root`` and tier 2 at ``url``, save step
    ``saved`` (``close()`` drains its upload), call ``uploaded()`` (the caller's checks of
    what the store holds), wipe ``root``, then restore from tier 2 alone: step ``saved``
    from ``tier2`` with every sample counted, and steps after it up to ``end`` bit-identical
    to an uninterrupted run's."""
    reference = tiny_train(tiny_state(width=width), range(0, end), batch)
    st = tiny_state(width=width)
    with tierckpt.CheckpointManager(tier1=root, tier2=url, keep_last=2) as ck:
        assert tiny_train(st, range(0, saved + 1), batch) == reference[:saved + 1]
        ck.save(saved, st).wait()
    uploaded()
    shutil.rmtree(root)  # the node is gone: tier 2 alone
    st2 = tiny_state(seed=99, width=width)
    with tierckpt.CheckpointManager(tier1=root, tier2=url) as ck:
        info = ck.restore(st2)
        assert info is not None and (info.step, info.source) == (saved, "tier2")
        assert st2.extra["seen"] == (saved + 1) * batch
        assert tiny_train(st2, range(saved + 1, end), batch) == reference[saved + 1:]
    assert any(e["event"] == events.RESTORE_DONE for e in events.read_events(root / layout.EVENTS))
