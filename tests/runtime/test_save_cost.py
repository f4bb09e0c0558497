"""SaveCostMeter: a save's whole cost is its window (save() entry → first step mark after it
committed) less the window's steps at the idle step time, emitted as ``save_cost``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.runtime import events as ev
from tierckpt.runtime.save_cost import MIN_IDLE, SaveCostMeter


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _costs(path: Path) -> list[dict]:
    return [r for r in ev.read_events(path) if r["event"] == ev.SAVE_COST]


def test_cost_is_the_window_less_its_steps_at_the_idle_step_time(tmp_path: Path) -> None:
    clock = _Clock()
    with ev.EventLog(tmp_path / "e.jsonl") as log:
        m = SaveCostMeter(log, clock=clock)
        for dt in (0.0, 0.1, 0.1, 0.1, 0.3, 0.1):  # idle steps: median 0.1 (0.3 an outlier)
            clock.t += dt
            m.mark(busy=False)
        m.saving(7, started=clock.t)
        clock.t += 0.02  # save() blocked 20 ms
        for dt in (0.15, 0.15, 0.15):  # three slower steps while the save writes
            clock.t += dt
            m.mark(busy=True)
        clock.t += 0.1
        m.mark(busy=False)  # committed: this step closes the window
        clock.t += 0.1
        m.mark(busy=False)  # idle again: not part of any window
    (c,) = _costs(tmp_path / "e.jsonl")
    assert c["step"] == 7 and c["steps"] == 4 and c["step_s"] == pytest.approx(0.1)
    assert c["window_s"] == pytest.approx(0.02 + 3 * 0.15 + 0.1)
    assert c["seconds"] == pytest.approx(0.02 + 3 * 0.05)  # C + what the steps lost


def test_no_cost_before_enough_idle_steps_or_without_a_step(tmp_path: Path) -> None:
    clock = _Clock()
    with ev.EventLog(tmp_path / "e.jsonl") as log:
        m = SaveCostMeter(log, clock=clock)
        for _ in range(MIN_IDLE - 1):  # MIN_IDLE - 2 idle intervals
            clock.t += 0.1
            m.mark(busy=False)
        m.saving(1, started=clock.t)
        clock.t += 0.2
        m.mark(busy=False)
        assert _costs(tmp_path / "e.jsonl") == []  # too few idle steps to know the rate
        for _ in range(MIN_IDLE + 1):
            clock.t += 0.1
            m.mark(busy=False)
        m.saving(2, started=clock.t)
        clock.t += 0.5
        m.saving(3, started=clock.t)  # no step marked between two saves: nothing to say
        clock.t += 0.3
        m.mark(busy=False)
    (c,) = _costs(tmp_path / "e.jsonl")
    assert c["step"] == 3 and c["steps"] == 1
    assert c["seconds"] == pytest.approx(0.3 - 0.1)
