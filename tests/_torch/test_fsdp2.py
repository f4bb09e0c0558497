"""What :mod:`tierckpt._torch.fsdp2` resets of an FSDP2 step that failed part-way, in a
real two-rank gloo group: the next step after it is the step an untouched model takes — the
same gradients, and the same collectives (a survivor that made one more than the
replacement, a stale backward prefetch, hung the first step after a heal)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._launch import spawn
from tierckpt._ports import free_port
from tierckpt._torch import fsdp2

_WORLD = 2  # both ranks fail alike and are healed alike (FSDP2 skips collectives at 1)


class _Peer(RuntimeError):
    """Stands for the collective error a dead peer raises inside the backward."""


def _model(fail: list[bool], root_params: bool) -> nn.Module:
    """Three FSDP2 layers, and a root with a head of its own or none; the backward raises
    once the gradient reaches the middle layer's output. With a head, its gradients are
    on its unsharded parameters then (the root's post-backward runs last); without, the
    root has no parameter group, and the failed step's forward order is still recorded
    (the end of the backward clears it), where the next backward's last prefetch looks."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
    model = nn.Sequential(*layers, *([nn.ReLU(), nn.Linear(4, 4)] if root_params else []))

    def raise_in_backward(_m: nn.Module, _args: object, out: torch.Tensor) -> None:
        if fail[0]:
            out.register_hook(lambda g: (_ for _ in ()).throw(_Peer("peer died")))
    model[2].register_forward_hook(raise_in_backward)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _grads(model: nn.Module, calls: list[str]) -> list[torch.Tensor]:
    """One step's gradients; ``calls`` gets the step's FSDP2 collectives, in order."""
    real = dist.all_gather_single, dist.reduce_scatter_single

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return call
    model.zero_grad(set_to_none=True)
    try:
        dist.all_gather_single = counted("all_gather", real[0])
        dist.reduce_scatter_single = counted("reduce_scatter", real[1])
        model(torch.ones(3, 8)).square().sum().backward()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def _worker(rank: int, port: int, out: str, root_params: bool) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, _WORLD, is_master=rank == 0)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank,
                            world_size=_WORLD)
    try:
        want_calls: list[str] = []
        want = _grads(_model([False], root_params), want_calls)
        fail = [True]
        model = _model(fail, root_params)
        sharded = list(model.parameters())  # what an optimizer holds
        with pytest.raises(_Peer):
            _grads(model, [])
        fail[0] = False
        for p in sharded:  # as if the loop zeroed gradients only after step()
            p.grad = torch.ones_like(p)
        fsdp2.detach(model)  # what a heal does: leave, form the next group, rebind
        dist.init_process_group("gloo", store=dist.PrefixStore("gen1/", store), rank=rank,
                                world_size=_WORLD)
        assert fsdp2.rebind_fsdp(model) == 3 + root_params
        assert all(p.grad is None for p in sharded)
        calls: list[str] = []
        got = _grads(model, calls)
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        if rank == 0:
            Path(out).write_text(f"{same} {calls == want_calls} {calls} {want_calls}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("root_params", [True, False], ids=["head", "no-head"])
def test_a_backward_that_failed_part_way_leaves_nothing_behind(
        tmp_path: Path, root_params: bool) -> None:
    # with a head: its gradient of the failed step, or a sharded one a loop had not zeroed
    # yet, would be added to the next backward's (the first update after a heal wrong);
    # without: a prefetch of the failed step's order would make one all-gather more than
    # the replacement makes (the first step after a heal hung for the group's timeout)
    out = tmp_path / "same"
    spawn(_worker, free_port(), str(out), root_params, nprocs=_WORLD)
    same, same_calls, *calls = out.read_text().split(" ", 2)
    assert same == "True"
    assert same_calls == "True", calls


def _ddp_worker(rank: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=0,
                            world_size=1)
    plain = nn.Linear(4, 4)
    ddp = DistributedDataParallel(plain)  # held by the loop (here), not by tierckpt
    ddp(torch.ones(2, 4)).sum().backward()
    again = DistributedDataParallel(nn.Linear(4, 4))  # the state's model is the wrapper
    found = [fsdp2._ddp_wrappers(plain) == [ddp], fsdp2._ddp_wrappers(again) == [again],
             fsdp2._ddp_wrappers(nn.Linear(4, 4)) == []]
    fsdp2.detach(plain)
    fsdp2.detach(again)
    emptied = [w.reducer is None and w.logger is None and w.process_group is None
               for w in (ddp, again)]
    Path(out).write_text(f"{all(found)} {all(emptied)}")


def test_a_ddp_wrapper_lets_go_of_the_failed_group(tmp_path: Path) -> None:
    # the wrapper held the group in itself, its reducer and the reducer's logger, and at
    # world 4 a survivor waited on its live neighbour until it was replaced as stuck; the
    # effect is tests/heal/test_heal_jobs.py::test_ddp_world4_heals_in_place_and_bit_identically
    out = tmp_path / "ddp"
    spawn(_ddp_worker, free_port(), str(out), nprocs=1)
    assert out.read_text() == "True True"
