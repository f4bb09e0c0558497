"""CheckpointManager(interval=...) on a real job: should_save follows a fixed interval, and
an AutoInterval's τ moves when the measured blocking time C changes (saves slowed by a
state-dict hook that sleeps, inside the timed staging)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
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


def test_should_save_needs_an_interval(tmp_path: Path) -> None:
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck, \
            pytest.raises(ConfigError, match="interval="):
        ck.should_save(0)
    with pytest.raises(ConfigError, match="interval must be"):
        tierckpt.CheckpointManager(tier1=tmp_path, interval=600)


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
    early, late = decided[3]["interval_s"], decided[-1]["interval_s"]
    assert late > 3 * early, (early, late)  # √20 ≈ 4.5 in theory
    assert decided[-1]["inputs"]["C_source"].startswith("measured")
    assert decided[-1]["inputs"]["mtbf_source"] == "given" and decided[-1]["M_s"] > 0
    gaps = [b["step"] - a["step"] for a, b in itertools.pairwise(decided)]
    assert max(gaps[-3:]) > max(gaps[1:4])  # the steps between saves grew with τ
