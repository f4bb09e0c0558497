"""``StateCapture`` returns exactly what ``get_state_dict`` returns — same keys in the same
order, the live tensors, current hyperparameters — while calling ``get_state_dict`` itself
only when the structure changes, for plain, DDP-wrapped and FSDP2 models."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests._launch import spawn
from tierckpt import state_capture
from tierckpt._ports import free_port
from tierckpt.state_capture import StateCapture, _same


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(3, 8)).sum().backward()
    opt.step()


def _reference(model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple:
    return get_state_dict(model, () if opt is None else opt)


def _compiled() -> nn.Module:
    return torch.compile(_model(), backend="eager")  # keys: "_orig_mod.<fqn>"


def _checkpointed() -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    model = _model()
    model[0] = checkpoint_wrapper(model[0])
    return model


@pytest.mark.parametrize("build", [_model, _compiled, _checkpointed],
                         ids=["plain", "compiled", "ckpt-wrapper"])
def test_matches_get_state_dict_and_reuses_the_renaming(build: Any) -> None:
    # wrappers' prefixes are renamed away as get_state_dict does
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    capture = StateCapture(model, opt)
    for i in range(4):
        got = capture()
        assert _same(got, _reference(model, opt)), f"call {i}"
        assert all("_orig_mod" not in k and "_checkpoint_wrapped" not in k for k in got[0])
        _step(model, opt)
    assert capture.reference_calls == 1  # only the first call derived the renaming


def test_values_and_hyperparameters_are_live() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    capture = StateCapture(model, opt)
    capture()
    _step(model, opt)
    opt.param_groups[0]["lr"] = 0.5
    msd, osd = capture()
    assert capture.reference_calls == 1
    assert torch.equal(msd["0.weight"], model[0].weight)
    assert msd["0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert osd["param_groups"][0]["lr"] == 0.5
    assert int(osd["state"]["3.bias"]["step"]) == 2
    assert torch.equal(osd["state"]["3.bias"]["exp_avg"], opt.state[model[3].bias]["exp_avg"])


def test_a_new_parameter_group_is_seen() -> None:
    model = _model()
    opt = torch.optim.SGD(list(model[0].parameters()), lr=0.1, momentum=0.9)
    _step(model, opt)
    capture = StateCapture(model, opt)
    capture()
    opt.add_param_group({"params": list(model[3].parameters()), "lr": 0.01})
    _step(model, opt)
    got = capture()
    assert capture.reference_calls == 2
    assert _same(got, _reference(model, opt))
    assert got[1]["param_groups"][1]["params"] == ["3.weight", "3.bias"]


def test_reordered_optimizer_parameters_are_seen() -> None:
    # the optimizer's parameter ids are positions: a new order renames every state entry
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    capture = StateCapture(model, opt)
    capture()
    opt.param_groups[0]["params"].reverse()
    _step(model, opt)
    got = capture()
    assert capture.reference_calls == 2
    assert _same(got, _reference(model, opt))
    assert got[1]["param_groups"][0]["params"][0] == "3.bias"


def test_a_replaced_parameter_is_seen() -> None:
    model = _model()
    capture = StateCapture(model, None)
    capture()
    model[0].weight = nn.Parameter(torch.zeros(16, 8))
    msd, _ = capture()
    assert capture.reference_calls == 2
    assert msd["0.weight"].data_ptr() == model[0].weight.data_ptr()


def test_without_state_get_state_dict_initialises_it() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    capture = StateCapture(model, opt)
    _, osd = capture()  # no step yet, no gradients: get_state_dict's zero-gradient step
    assert capture.reference_calls == 1
    assert set(osd["state"]) == {k for k, _ in model.named_parameters()}


@pytest.mark.parametrize("cls, kw", [(torch.optim.Adam, {}), (torch.optim.AdamW, {}),
                                      (torch.optim.Adam, {"amsgrad": True}),
                                      (torch.optim.AdamW, {"foreach": True})],
                         ids=["adam", "adamw", "amsgrad", "foreach"])
def test_adam_state_is_primed_as_its_first_step_makes_it(cls: Any, kw: dict) -> None:
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    model, ref_model = _model(), _model()
    model[1].weight.requires_grad_(False)
    ref_model[1].weight.requires_grad_(False)
    opt, ref = cls(model.parameters(), **kw), cls(ref_model.parameters(), **kw)
    capture = StateCapture(model, opt)
    _, osd = capture()
    _init_optim_state(ref)  # DCP's zero-gradient step
    assert capture.reference_calls == 1  # the renaming, learnt: no zero-gradient step
    got = [sorted((k, v.dtype, v.device, tuple(v.shape)) for k, v in opt.state[p].items())
           for p in model.parameters()]
    want = [sorted((k, v.dtype, v.device, tuple(v.shape)) for k, v in ref.state[p].items())
            for p in ref_model.parameters()]
    assert got == want and got[2] == []  # the same state, none for a frozen parameter
    assert set(osd["state"]) == {k for k, p in model.named_parameters() if p.requires_grad}
    assert all(v.eq(0).all() for s in opt.state.values() for v in s.values())
    # a primed optimizer's first step is a fresh one's, bit for bit (DCP's leaves step 1)
    fresh_model = _model()
    fresh_model[1].weight.requires_grad_(False)
    fresh = cls(fresh_model.parameters(), **kw)
    for m, o in ((model, opt), (fresh_model, fresh)):
        torch.manual_seed(1)
        _step(m, o)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(),
                                                strict=True))
    assert [float(opt.state[p]["step"]) for p in model.parameters() if p.requires_grad] == \
        [1.0] * 5


def test_other_optimizers_and_stateful_ones_are_not_primed() -> None:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert not state_capture.prime_state(sgd) and not sgd.state

    class MyAdam(torch.optim.Adam):
        pass

    assert not state_capture.prime_state(MyAdam(model.parameters()))
    adam = torch.optim.Adam(model.parameters())
    _step(model, adam)
    before = {id(v) for s in adam.state.values() for v in s.values()}
    assert not state_capture.prime_state(adam)  # it has state: left as it is
    assert before == {id(v) for s in adam.state.values() for v in s.values()}


def test_without_optimizer() -> None:
    model = _model()
    capture = StateCapture(model, None)
    for _ in range(2):
        assert _same(capture(), _reference(model, None))
    assert capture.reference_calls == 1


def test_an_optimizer_with_its_own_state_dict_always_takes_get_state_dict() -> None:
    class Custom(torch.optim.SGD):
        def state_dict(self) -> dict:  # type: ignore[override]
            return super().state_dict()

    model = _model()
    opt = Custom(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    capture = StateCapture(model, opt)
    for _ in range(3):
        assert _same(capture(), _reference(model, opt))
    assert capture.reference_calls == 3


def test_a_mismatch_with_get_state_dict_turns_the_fast_path_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # get_state_dict returning copies, not the live tensors (no model with the default
    # options does: a stand-in), is something the fast path cannot reproduce
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)

    def odd(m: nn.Module, o: torch.optim.Optimizer) -> tuple:
        msd, osd = get_state_dict(m, o)
        return {k: v.clone() for k, v in msd.items()}, osd

    monkeypatch.setattr(state_capture, "get_state_dict", odd)
    capture = StateCapture(model, opt)
    for _ in range(3):
        msd, _ = capture()
        assert msd["0.weight"].data_ptr() != model[0].weight.data_ptr()  # the stand-in's
    assert capture.reference_calls == 3


def test_same_compares_order_storage_and_values() -> None:
    t = torch.ones(4)
    assert _same({"a": t, "b": [1, 2.0]}, {"a": t.detach(), "b": [1, 2.0]})
    assert not _same({"a": t, "b": 1}, {"b": 1, "a": t})   # order
    assert not _same({"a": t}, {"a": t.clone()})             # another storage
    assert not _same({"a": t}, {"a": t.view(2, 2)})          # another shape
    assert not _same({"a": [1, 2]}, {"a": (1, 2)})           # another container
    assert not _same({"lr": 0.1}, {"lr": 0.2})


def _wrapped_worker(rank: int, world: int, port: int, kind: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard
            fully_shard(model[0])
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _step(model, opt)
        capture = StateCapture(model, opt)
        results = []
        for _ in range(3):
            got = capture()
            results.append(_same(got, _reference(model, opt)))
            _step(model, opt)
        keys = sorted(got[0])
        Path(out, f"rank{rank}").write_text(f"{all(results)} {capture.reference_calls} {keys}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_wrapped_models_match_get_state_dict(tmp_path: Path, kind: str) -> None:
    spawn(_wrapped_worker, 2, free_port(), kind, str(tmp_path), nprocs=2)
    want = sorted(["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"])
    for rank in range(2):
        assert Path(tmp_path, f"rank{rank}").read_text() == f"True 1 {want}"
