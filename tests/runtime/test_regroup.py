"""What :mod:`tierckpt.runtime.regroup` resets of an FSDP2 step that failed part-way, in a
real one-rank gloo group: the next step after it is the step an untouched model takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._launch import free_port, spawn
from tierckpt.runtime import regroup


class _Peer(RuntimeError):
    """Stands for the collective error a dead peer raises inside the backward."""


def _model(fail: list[bool]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def raise_in_backward(_m: nn.Module, _args: object, out: torch.Tensor) -> None:
        if fail[0]:  # the head's gradients exist, the root's post-backward has not run
            out.register_hook(lambda g: (_ for _ in ()).throw(_Peer("peer died")))
    model[0].register_forward_hook(raise_in_backward)
    fully_shard(model[0])
    fully_shard(model)
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(torch.ones(3, 8)).square().sum().backward()
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def _worker(rank: int, port: int, out: str, path: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank,
                            world_size=1)
    try:
        want = _grads(_model([False]))
        fail = [True]
        model = _model(fail)
        sharded = list(model.parameters())  # what an optimizer holds
        with pytest.raises(_Peer):
            _grads(model)
        fail[0] = False
        if path == "rebind":  # FSDP2's own leftovers alone, on the same group
            assert regroup.rebind_fsdp(model) == 2
        else:  # what a heal does: leave, form the next group, rebind
            for p in sharded:  # as if the loop zeroed gradients only after step()
                p.grad = torch.ones_like(p)
            regroup.detach(model)
            dist.init_process_group("gloo", store=dist.PrefixStore("gen1/", store),
                                    rank=rank, world_size=1)
            assert regroup.rebind_fsdp(model) == 2
            assert all(p.grad is None for p in sharded)
        got = _grads(model)
        Path(out).write_text(str(all(torch.equal(a, b) for a, b in zip(got, want,
                                                                       strict=True))))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["rebind", "heal"])
def test_a_backward_that_failed_part_way_leaves_no_gradient_behind(
        tmp_path: Path, path: str) -> None:
    # the failed backward wrote the head's gradient to its unsharded parameter: were it
    # left there (or a sharded gradient a loop had not zeroed yet), the next backward would
    # add to it, and the first update after a heal would be wrong
    out = tmp_path / "same"
    spawn(_worker, free_port(), str(out), path, nprocs=1)
    assert out.read_text() == "True"
