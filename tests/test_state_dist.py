"""Per-rank state is never merged across ranks by DCP's de-duplication.

Two ranks whose models hold differently named parameters (pipeline stages do): plain DCP
de-duplicates the optimizer's ``param_groups`` across ranks and cannot restore this;
tierckpt keeps every rank's groups, RNG and extras in that rank's own blob.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tierckpt
from tests._launch import spawn
from tierckpt._ports import free_port


def _build(rank: int) -> torch.nn.Module:
    m = torch.nn.Module()
    for i in range(2 + rank):  # different names and counts per rank
        m.register_parameter(f"stage{rank}_{i}", torch.nn.Parameter(torch.randn(300)))
    return m


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    m = _build(rank)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    o.step()
    extra = {"rank_tokens": 100 + rank}
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(0, tierckpt.TrainState(model=m, optimizer=o, extra=extra)).wait()
    torch.manual_seed(99)
    m2 = _build(rank)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    extra2: dict = {}
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.restore(tierckpt.TrainState(model=m2, optimizer=o2, extra=extra2))
    same = all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    moms = all(torch.equal(o.state[a]["momentum_buffer"], o2.state[b]["momentum_buffer"])
               for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    Path(out, f"rank{rank}").write_text(f"{same} {moms} {extra2.get('rank_tokens')}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_with_different_parameters_restore_exactly(tmp_path: Path) -> None:
    spawn(_worker, 2, free_port(), str(tmp_path / "t1"), str(tmp_path), nprocs=2)
    assert (tmp_path / "rank0").read_text() == "True True 100"
    assert (tmp_path / "rank1").read_text() == "True True 101"
