"""HostStager and the overlap gate: background copies of parameters and optimizer state,
what a save writes when the next step follows at once, and what an in-place write during
the copy does. Real managers, real files; the only lever is holding the stager's
background queue so a copy is provably still running when the test writes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt import Writes
from tierckpt.errors import ConfigError, SaveError, StagingRaceError
from tierckpt.save.staging import HostStager


def _hold(stager: HostStager) -> threading.Event:
    """Queue a task that blocks the stager's background copies until the event is set."""
    gate = threading.Event()
    stager._background.submit(gate.wait)
    return gate


def test_defer_splits_copies_and_ready_resolves() -> None:
    stager = HostStager(copy_threads=2)
    try:
        a, b = torch.randn(1000, 100), torch.randn(10)
        gate = _hold(stager)
        staged = stager.stage({"a": a, "b": b, "n": 3}, defer=lambda path, t: path == ("a",))
        assert torch.equal(staged.tree["b"], b) and staged.tree["n"] == 3  # copied at once
        assert staged.deferred_bytes == a.numel() * 4 and staged.nbytes == (1000 * 100 + 10) * 4
        assert not staged.ready.done()
        gate.set()
        assert staged.ready.result(10) >= 0.0
        assert torch.equal(staged.tree["a"], a)
        again = stager.stage({"a": a, "b": b, "n": 3})  # sync: nothing deferred, buffers reused
        assert again.ready.done() and again.deferred_bytes == 0 and stager.allocations == 2
    finally:
        stager.close()


def test_in_place_write_during_background_copy_is_caught() -> None:
    stager = HostStager(copy_threads=2)
    try:
        a = torch.randn(256, 256)
        gate = _hold(stager)
        staged = stager.stage({"a": a}, defer=lambda path, t: True)
        a.mul_(2)  # the copy has not run yet: it would read the new values
        gate.set()
        with pytest.raises(StagingRaceError, match="staging='sync'"):
            staged.ready.result(10)
    finally:
        stager.close()


def _job(seed: int = 0) -> tuple[tierckpt.TrainState, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierckpt.TrainState(model=model, optimizer=opt), model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(32, 512)).square().mean().backward()
    opt.step()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def test_step_right_after_save_waits_and_the_checkpoint_holds_the_saved_step(
        tmp_path: Path) -> None:
    """The step that follows save() would change every parameter, buffer (BatchNorm running
    stats, written in forward) and Adam moment: the checkpoint must hold the values at
    save() all the same, with the step held until the copy landed."""
    st, model, opt = _job()
    _step(model, opt)
    with tierckpt.CheckpointManager(tier1=tmp_path, writes=Writes(fsync=False)) as ck:
        snap = _snapshot(model, opt)
        gate = _hold(ck._g.stager)
        h = ck.save(1, st)
        assert not h.staged.done()  # parameters and moments are still being copied
        release = threading.Timer(0.3, gate.set)
        release.start()
        _step(model, opt)  # its forward writes the BatchNorm stats; its step waits
        assert h.staged.done()
        assert h.staged.result() >= 0.25  # the wait in the step pre-hook is blocked time
        h.wait(30)
    st2, model2, opt2 = _job(seed=5)
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        assert ck.restore(st2) is not None
    got = _snapshot(model2, opt2)
    assert got.keys() == snap.keys()
    assert all(torch.equal(got[k], snap[k]) for k in snap)
    rec = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    staged = [r for r in rec if r["event"] == "save_staged"]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert len(staged) == 1 and staged[0]["deferred_bytes"] >= 3 * params  # + 2 moments
    assert staged[0]["seconds"] >= 0.25 and staged[0]["copy_seconds"] >= 0.25


def test_in_place_write_outside_step_fails_that_save_only(tmp_path: Path) -> None:
    st, model, opt = _job()
    _step(model, opt)
    with tierckpt.CheckpointManager(tier1=tmp_path, writes=Writes(fsync=False)) as ck:
        gate = _hold(ck._g.stager)
        ck.save(1, st)
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # breaks the rule: written outside optimizer.step()
        gate.set()
        with pytest.raises(SaveError, match="changed in place"):
            ck.wait(30)  # raised once, like any failed save
        _step(model, opt)
        assert ck.save(2, st).wait(30).step == 2  # the next save is unaffected
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002"]


def test_sync_staging_copies_everything_before_save_returns(tmp_path: Path) -> None:
    st, model, opt = _job()
    _step(model, opt)
    with tierckpt.CheckpointManager(tier1=tmp_path,
                                    writes=Writes(fsync=False, staging="sync")) as ck:
        gate = _hold(ck._g.stager)  # nothing may depend on the background queue
        h = ck.save(1, st)
        assert h.staged.done()
        gate.set()
        h.wait(30)
    rec = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r.get("deferred_bytes") for r in rec if r["event"] == "save_staged"] == [None]


def test_staging_mode_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"staging must be one of \['overlap', 'sync'\]"):
        tierckpt.CheckpointManager(tier1=tmp_path, writes=Writes(staging="async"))


def test_many_small_tensors_and_a_large_one_are_all_copied() -> None:
    # hundreds of small tensors (a transformer's biases and norms) go to the copy threads
    # in a few batches; the large one in 8 MiB pieces among them
    from tierckpt._runs import contiguous_runs

    stager = HostStager(copy_threads=2)
    try:
        sd = {f"b{i}": torch.randn(17 + i % 5) for i in range(500)}
        sd["big"] = torch.randn(5 * 1024 * 1024)  # 20 MiB
        staged = stager.stage(sd)
        assert all(torch.equal(staged.tree[k], v) for k, v in sd.items())
        assert all(staged.tree[k].data_ptr() != v.data_ptr() for k, v in sd.items())
    finally:
        stager.close()
    pieces = [(torch.empty(n), torch.empty(n)) for n in [1] * 300 + [1000] * 4]
    batches = contiguous_runs(pieces, 4, lambda p: p[0].numel())
    assert len(batches) == 4 and [p for b in batches for p in b] == pieces  # order kept
    assert max(sum(d.numel() for d, _ in b) for b in batches) <= 1300
