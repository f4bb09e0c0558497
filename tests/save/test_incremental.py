"""Incremental saves (``Writes(incremental=True)``): a LoRA-shaped job's frozen base is copied
and written once; later steps hard-link its file, restore bit for bit, read with plain
``dcp.load``, survive the retention of the step that wrote it, and upload only what changed.
A frozen tensor changed in place is written again; one changed through ``.data`` (invisible
to the version counter) at the next full save, as documented."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import tierckpt
from tierckpt import Writes
from tierckpt.format import layout
from tierckpt.runtime import events

BASE, RANK = 256, 4


class Lora(nn.Module):
    """A frozen base of two square layers and a trainable low-rank adapter on each."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(BASE, BASE) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(BASE, RANK, bias=False) for _ in range(2))
        self.up = nn.ModuleList(nn.Linear(RANK, BASE, bias=False) for _ in range(2))
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b, d, u in zip(self.base, self.down, self.up, strict=True):
            x = torch.tanh(b(x) + u(d(x)))
        return x


def _state(seed: int = 0) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    model = Lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return tierckpt.TrainState(model=model, optimizer=opt)


def _train(st: tierckpt.TrainState, steps: range) -> list[float]:
    out = []
    for step in steps:
        x = torch.randn(8, BASE, generator=torch.Generator().manual_seed(step))
        loss = st.model(x).pow(2).mean()
        st.optimizer.zero_grad()
        loss.backward()
        st.optimizer.step()
        out.append(loss.item())
    return out


def _frozen_file(root: Path, step: int) -> Path:
    """The one file of the step whose inode more than one step shares, or the frozen file
    by its name (``__0_1.distcp``: one writer thread, then the frozen file)."""
    return root / layout.step_dirname(step) / "__0_1.distcp"


def _durable(root: Path) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in events.read_events(root / layout.EVENTS)
            if e["event"] == events.SAVE_DURABLE}


def _save_steps(root: Path, st: tierckpt.TrainState, saves: range, **writes: Any) -> None:
    with tierckpt.CheckpointManager(tier1=root, keep_last=10,
                                    writes=Writes(incremental=True, **writes)) as ck:
        for step in saves:
            _train(st, range(step, step + 1))
            ck.save(step, st).wait()


def test_the_frozen_base_is_written_once_and_linked_after(tmp_path: Path) -> None:
    root = tmp_path / "t1"
    st = _state()
    _save_steps(root, st, range(4))
    inodes = {s: _frozen_file(root, s).stat().st_ino for s in range(4)}
    assert len(set(inodes.values())) == 1  # one file for every step
    base_bytes = sum(p.numel() * 4 for p in st.model.base.parameters())
    durable = _durable(root)
    assert durable[0]["linked"] == 0 and durable[0]["kept"] == 0  # the first save writes it
    for step in (1, 2, 3):  # then neither copied to host memory nor written
        assert durable[step]["kept"] == base_bytes
        assert durable[step]["linked"] == _frozen_file(root, step).stat().st_size
        assert durable[step]["linked"] >= base_bytes  # the frozen file holds the base
    fresh = _state(seed=9)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        info = ck.restore(fresh)
    assert info is not None and info.step == 3
    for a, b in zip(st.model.state_dict().values(), fresh.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    assert _train(fresh, range(4, 8)) == _train(st, range(4, 8))  # bit-identical on


def test_plain_dcp_load_reads_a_linked_step(tmp_path: Path) -> None:
    root = tmp_path / "t1"
    st = _state()
    _save_steps(root, st, range(3))
    assert _frozen_file(root, 2).stat().st_nlink == 3
    target = {"model": {k: torch.zeros_like(v) for k, v in st.model.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(root / layout.step_dirname(2)))
    for k, v in st.model.state_dict().items():
        assert torch.equal(target["model"][k], v), k


def test_retention_of_the_step_that_wrote_it_keeps_the_file(tmp_path: Path) -> None:
    root = tmp_path / "t1"
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=1,
                                    writes=Writes(incremental=True)) as ck:
        for step in range(3):
            _train(st, range(step, step + 1))
            ck.save(step, st).wait()
    assert [p.name for p in root.glob("step-*")] == [layout.step_dirname(2)]
    assert _durable(root)[2]["linked"] > 0  # linked from step 1, which retention removed
    fresh = _state(seed=9)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        info = ck.restore(fresh)
    assert info is not None and info.step == 2
    assert torch.equal(fresh.model.base[0].weight, st.model.base[0].weight)


def test_a_frozen_tensor_changed_in_place_is_written_again(tmp_path: Path) -> None:
    root = tmp_path / "t1"
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=10,
                                    writes=Writes(incremental=True)) as ck:
        ck.save(0, st).wait()
        ck.save(1, st).wait()
        with torch.no_grad():
            st.model.base[1].bias.add_(1.0)  # an in-place write: the version counter moves
        ck.save(2, st).wait()
    durable = _durable(root)
    assert durable[1]["linked"] > 0 and durable[2]["linked"] == 0
    bias = st.model.base[1].bias
    assert durable[2]["kept"] == durable[1]["kept"] - bias.numel() * 4  # all but the bias
    assert _frozen_file(root, 2).stat().st_ino != _frozen_file(root, 1).stat().st_ino
    fresh = _state(seed=9)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.restore(fresh)
    assert torch.equal(fresh.model.base[1].bias, st.model.base[1].bias)


def test_a_write_through_data_is_saved_at_the_next_full_save(tmp_path: Path) -> None:
    """The documented limit: ``.data`` bypasses the version counter, so the change reaches
    the checkpoint at the next full save (``full_every``), not before."""
    root = tmp_path / "t1"
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=10,
                                    writes=Writes(incremental=True, full_every=3)) as ck:
        ck.save(0, st).wait()
        st.model.base[0].weight.data.mul_(2.0)
        for step in (1, 2, 3):
            ck.save(step, st).wait()
    durable = _durable(root)
    assert [durable[s]["linked"] > 0 for s in range(4)] == [False, True, True, False]
    assert len({_frozen_file(root, s).stat().st_ino for s in range(4)}) == 2
    weight = st.model.base[0].weight
    loaded = {s: {"model": {"base.0.weight": torch.zeros_like(weight)}} for s in (2, 3)}
    for s, target in loaded.items():
        dcp.load(target, checkpoint_id=str(root / layout.step_dirname(s)))
    assert torch.equal(loaded[2]["model"]["base.0.weight"] * 2, weight)  # the stale copy
    assert torch.equal(loaded[3]["model"]["base.0.weight"], weight)  # the full save's


def test_off_by_default_every_save_writes_every_byte(tmp_path: Path) -> None:
    root = tmp_path / "t1"
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=10) as ck:
        for step in range(2):
            ck.save(step, st).wait()
    assert not _frozen_file(root, 1).exists()  # one shard file per rank, as before
    assert "linked" not in _durable(root)[1]
    names = {p.name for p in (root / layout.step_dirname(1)).iterdir()}
    assert os.stat(root / layout.step_dirname(1) / "__0_0.distcp").st_nlink == 1, names
