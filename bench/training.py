"""A small CPU training loop whose step rate shows how much a background save slows training.

The model is a 3-layer MLP sized so one step takes a few milliseconds on one core; the
loop is local (no collectives), so only CPU, memory bandwidth and the GIL are shared with
the save.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Loop:
    """One training loop; ``run`` counts steps until a condition says stop."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512),
                                   nn.ReLU(), nn.Linear(512, 256))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, 256, generator=gen)
        self.y = torch.randn(64, 256, generator=gen)
        self.step()  # warm up allocator and kernels

    def step(self) -> None:
        """One forward/backward/optimizer step."""
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def run(self, until: Callable[[], bool], start: float | None = None,
            min_seconds: float = 0.0) -> tuple[int, float]:
        """Step until ``until()`` and ``min_seconds`` have passed; (steps, seconds since start)."""
        t0 = time.perf_counter() if start is None else start
        steps = 0
        while True:
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds and until():
                return steps, elapsed
            self.step()
            steps += 1

    def idle_rate(self, seconds: float) -> float:
        """Steps per second with nothing else running."""
        steps, elapsed = self.run(lambda: True, min_seconds=seconds)
        return steps / elapsed


def summarize_throughput(ranks: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Per-rank paired rates → the run's figures.

    Each repeat measures the loop idle and then during a save, back to back, so both see
    the same background load; a repeat's ratio is during ÷ idle. Per rank the best repeat
    counts (noise only lowers it); the run's ratio is the worst rank's. The steps/s shown
    are means over ranks of that best pair.
    """
    best = []
    for r in ranks:
        pairs = list(zip(r["idle"], r["during"], strict=True))
        best.append(max(pairs, key=lambda p: p[1] / p[0]))
    return {"idle_steps_s": sum(i for i, _ in best) / len(best),
            "during_steps_s": sum(d for _, d in best) / len(best),
            "ratio": min(d / i for i, d in best),
            "pairs": [list(zip(r["idle"], r["during"], strict=True)) for r in ranks]}
