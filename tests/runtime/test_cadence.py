"""Cadence with an injected clock: the seconds per step and the interval it plans come from
the clock and the event log alone, so the numbers are exact (no sleeps, no thresholds)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tierckpt.policy.interval import AutoInterval, Every
from tierckpt.runtime import events as ev
from tierckpt.runtime.cadence import Cadence
from tierckpt.runtime.topology import Comm


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _run(tmp_path: Path, policy: AutoInterval | Every, blocked: list[float],
         step_s: float = 0.5, steps: int = 4000) -> list[dict]:
    """Train ``steps`` steps of ``step_s`` clock seconds; each save's C is the next of
    ``blocked`` (the last repeats). Returns the interval decisions."""
    path, clock = tmp_path / "events.jsonl", _Clock()
    with ev.EventLog(path) as log:
        cad = Cadence(policy, Comm(), log, path, clock=clock)
        saves = 0
        for step in range(steps):
            clock.t += step_s
            if cad.should_save(step):
                log.emit(ev.SAVE_STAGED, step=step, seconds=blocked[min(saves, len(blocked) - 1)],
                         bytes=1)
                cad.saved(step)
                saves += 1
    return [r for r in ev.read_events(path) if r["event"] == ev.INTERVAL_DECIDED]


def test_auto_interval_is_young_daly_from_the_measured_c_and_the_clock(tmp_path: Path) -> None:
    policy = AutoInterval(node_mtbf=3600.0, restart=0, min_interval=0, calibration_steps=3)
    decided = _run(tmp_path, policy, blocked=[0.5] * 12 + [8.0])
    assert len(decided) >= 14
    first = decided[4]
    assert first["step_s"] == pytest.approx(0.5)  # from the clock: no sleep was measured
    tau = first["interval_s"]
    assert tau == pytest.approx(math.sqrt(2 * 0.5 * first["M_s"]), rel=1e-6)
    assert first["next_step"] - first["step"] == pytest.approx(tau / 0.5, abs=1)
    late = decided[-1]  # C went from 0.5 s to 8 s: the median of the last 9 follows
    assert late["inputs"]["C"] == pytest.approx(8.0)
    assert late["interval_s"] == pytest.approx(tau * 4, rel=0.05)  # √(8/0.5) = 4
    assert late["next_step"] - late["step"] > 3 * (first["next_step"] - first["step"])


def test_every_seconds_turns_the_clock_into_steps(tmp_path: Path) -> None:
    decided = _run(tmp_path, Every(seconds=60), blocked=[0.01], step_s=2.0, steps=200)
    gaps = [d["next_step"] - d["step"] for d in decided[1:]]
    assert gaps and all(g == 30 for g in gaps), gaps  # 60 s / 2 s per step
