"""The job a drill runs, said once: :class:`DrillJob`, the fields the resume, preemption and
chaos drills share (the training command, where runs go, ranks and simulated nodes, the
seed, tier 2, the loss tolerance) and their checks. Each drill's config extends it with
its own fields and rules (``steps`` among them: each drill needs room for different things).

The heal drill's config does not extend it: one node, no tier 2, no tolerance (bit for bit),
and its report lists its config's fields as they are."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.url import parse_url

__all__ = ["DrillJob", "check_steps"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrillJob:
    """``command`` (the contract of :mod:`tierckpt.drill.launch`) with ``nproc`` ranks on
    each of ``nnodes`` simulated nodes, its runs under ``out`` (made absolute); ``seed``
    draws what the drill does to it; ``tier2`` defaults to ``file://<out>/tier2`` (a bad
    URL is refused now, not after a run); ``rtol`` None means bit for bit on CPU.
    ConfigError, raised on construction, names the flag to change."""

    USAGE: ClassVar[str] = "tierckpt drill -- python examples/train.py"
    """How the drill is called, shown when the command is missing."""

    command: tuple[str, ...]
    out: Path = Path("drill-out")
    nproc: int = 2
    nnodes: int = 1
    seed: int = 0
    tier2: str | None = None
    rtol: float | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError(f"give the training command, e.g. {self.USAGE}")
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "out", Path(self.out).absolute())
        for name in ("nproc", "nnodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name} must be an int >= 1, got {v!r}")
        if self.rtol is not None and not (math.isfinite(self.rtol) and self.rtol >= 0):
            raise ConfigError(f"--rtol must be a number >= 0, got {self.rtol!r}")
        if self.tier2 is None:
            object.__setattr__(self, "tier2", f"file://{self.out / 'tier2'}")
        parse_url(self.tier2, name="--tier2")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def roots(self, run: str, nnodes: int | None = None) -> tuple[Path, ...]:
        """The tier-1 roots of ``run``: ``runs/<run>/tier1`` on one node, else one
        ``runs/<run>/node<i>`` per node (``nnodes``, default this job's)."""
        n = self.nnodes if nnodes is None else nnodes
        base = self.out / "runs" / run
        return (base / "tier1",) if n == 1 else tuple(base / f"node{i}" for i in range(n))


def check_steps(steps: object, why: str = "") -> None:
    """ConfigError unless ``steps`` is an int >= 6 (``why``: what needs the room)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 6:
        raise ConfigError(f"--steps must be an int >= 6{why}, got {steps!r}")
