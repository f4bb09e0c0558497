"""CheckpointManager(interval=...) on a real job: should_save follows a fixed interval, and
an AutoInterval's τ moves when the measured blocking time C changes (saves slowed by a
state-dict hook that sleeps, inside the timed staging).

These runs use the wall clock, so they assert orderings and step marks only (which save,
how many steps apart, which events), never a threshold in seconds: the exact numbers are
checked with an injected clock in tests/runtime/test_cadence.py (τ from C and the step
time) and tests/runtime/test_save_cost.py (what slower steps add to a save's cost)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt import Writes
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.runtime import events


def _state(delay: list[float]) -> tierckpt.TrainState:
    torch.manual_seed(0)
    model = nn.Linear(16, 16)

    def slow(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        time.sleep(delay[0])  # staging calls state_dict(): this is blocking time C

    model._register_state_dict_hook(slow)
    return tierckpt.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                      lr=0.1))


def test_every_steps_is_the_readme_loop(tmp_path: Path) -> None:
    st = _state([0.0])
    saved = []
    with tierckpt.CheckpointManager(tier1=tmp_path, interval=tierckpt.Every(steps=4),
                                    keep_last=10) as ck:
        for step in range(10):
            if ck.should_save(step):
                ck.save(step, st).wait()
                saved.append(step)
    assert saved == [3, 7]


def test_without_an_interval_should_save_is_false_and_the_loop_decides(tmp_path: Path) -> None:
    st = _state([0.0])
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        assert not any(ck.should_save(step) for step in range(50))
        ck.save(3, st).wait()  # the loop's own choice still saves
    assert tierckpt.ManagerConfig(tier1=tmp_path).interval is None
    with pytest.raises(ConfigError, match="interval must be"):
        tierckpt.CheckpointManager(tier1=tmp_path, interval=600)


@pytest.mark.slow
def test_auto_interval_follows_the_measured_blocking_time(tmp_path: Path) -> None:
    delay = [0.01]
    st = _state(delay)
    auto = tierckpt.AutoInterval(node_mtbf=2.0, min_interval=0, calibration_steps=3)
    with tierckpt.CheckpointManager(tier1=tmp_path, interval=auto, keep_last=2) as ck:
        saves = 0
        step = 0
        while saves < 14:
            time.sleep(0.01)  # one training step
            if ck.should_save(step):
                ck.save(step, st).wait()
                saves += 1
                if saves == 5:
                    delay[0] = 0.2  # saves get slower: C grows twenty-fold
            step += 1
    decided = [e for e in events.read_events(tmp_path / layout.EVENTS)
               if e["event"] == events.INTERVAL_DECIDED]
    assert len(decided) == 14
    early, late = decided[3], decided[-1]
    assert late["inputs"]["C"] > early["inputs"]["C"]  # the slower saves were measured
    assert late["interval_s"] > early["interval_s"], (early, late)  # and τ followed
    assert decided[-1]["inputs"]["C_source"].startswith("measured")
    assert decided[-1]["inputs"]["mtbf_source"] == "given" and decided[-1]["M_s"] > 0
    gaps = [b["step"] - a["step"] for a, b in itertools.pairwise(decided)]
    assert max(gaps[-3:]) > max(gaps[1:4])  # the steps between saves grew with τ


@pytest.mark.slow
def test_auto_interval_plans_with_the_steps_a_background_save_slows(tmp_path: Path) -> None:
    # staging='overlap' makes C tiny; the cost moves into steps that run slower while the
    # save writes in the background. Here a step takes 10 ms, 60 ms while a save is in
    # flight (the loop asks the handle): the save_cost events must carry that slowdown, and
    # the interval decision must plan with it instead of C alone.
    torch.manual_seed(0)
    model = nn.Linear(1024, 2048)  # 8 MiB: each save writes (and fsyncs) for a few steps
    st = tierckpt.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0))
    auto = tierckpt.AutoInterval(node_mtbf=2.0, min_interval=0, calibration_steps=5)
    with tierckpt.CheckpointManager(tier1=tmp_path, interval=auto, keep_last=2) as ck:
        handle = None
        saves = step = busy_steps = 0
        while saves < 6:
            busy = handle is not None and not handle.done()
            busy_steps += busy
            time.sleep(0.06 if busy else 0.01)
            if ck.should_save(step):
                handle = ck.save(step, st)
                saves += 1
            step += 1
        ck.wait()
        for _ in range(3):  # the last save's window closes at the next step mark
            ck.should_save(step)
            step += 1
    recs = events.read_events(tmp_path / layout.EVENTS)
    staged = {e["step"]: e["seconds"] for e in recs if e["event"] == events.SAVE_STAGED}
    costs = [e for e in recs if e["event"] == events.SAVE_COST]
    assert len(costs) >= 4 and busy_steps >= 3, (costs, busy_steps)
    assert all(c["steps"] >= 1 and c["window_s"] >= c["seconds"] for c in costs), costs
    # what the meter saw: more than the blocked time (the busy steps were slower)
    lost = sum(c["seconds"] - staged[c["step"]] for c in costs)
    assert lost > 0, (lost, busy_steps, costs)
    decided = [e for e in recs if e["event"] == events.INTERVAL_DECIDED]
    assert "with the slower steps" in decided[-1]["inputs"]["C_source"]
    assert decided[-1]["inputs"]["C"] >= sorted(staged.values())[len(staged) // 2]


@pytest.mark.parametrize("staging", ["overlap", "sync"])
def test_without_an_interval_the_optimizer_steps_mark_the_save_cost(tmp_path: Path,
                                                                    staging: str) -> None:
    # a loop that saves on its own schedule and never calls should_save(): each
    # optimizer.step() is the step mark, so the slower steps are still measured
    torch.manual_seed(0)
    model = nn.Linear(1024, 2048)
    opt = torch.optim.SGD(model.parameters(), lr=0)
    st = tierckpt.TrainState(model=model, optimizer=opt)
    with tierckpt.CheckpointManager(tier1=tmp_path, keep_last=2,
                                    writes=Writes(staging=staging)) as ck:
        handle = None
        busy_steps = 0
        for step in range(60):
            busy = handle is not None and not handle.done()
            # the step pre-hook (the marks) exists from the first save on: its window has
            # no idle steps to compare with, so it is not counted
            busy_steps += busy and step > 10
            time.sleep(0.06 if busy else 0.01)  # forward/backward
            opt.step()
            if step % 10 == 5:
                handle = ck.save(step, st)
        ck.wait()
        for _ in range(2):  # the last window closes at the next step
            opt.step()
    recs = events.read_events(tmp_path / layout.EVENTS)
    staged = {e["step"]: e["seconds"] for e in recs if e["event"] == events.SAVE_STAGED}
    costs = [e for e in recs if e["event"] == events.SAVE_COST]
    assert len(costs) >= 4 and busy_steps >= 3, (costs, busy_steps)
    lost = sum(c["seconds"] - staged[c["step"]] for c in costs)
    assert lost > 0, (lost, busy_steps, costs)
