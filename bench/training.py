"""A small CPU training loop whose step rate shows how much a background save slows training.

The model is a 3-layer MLP sized so one step takes a few milliseconds on one core; the
loop is local (no collectives), so only CPU, memory bandwidth and the GIL are shared with
the save.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
