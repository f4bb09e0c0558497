"""When to save: fixed intervals and an interval that follows the run's own measurements.
Pure: values in, decisions out; the manager supplies the measurements and the clock.

Policies (what the user passes as ``CheckpointManager(interval=...)``):

- :class:`Every` — ``Every(steps=500)`` saves when ``(step + 1) % 500 == 0``;
  ``Every(seconds=600)`` about every ten minutes of training.
- :class:`AutoInterval` — τ from Young/Daly (:func:`tierckpt.policy.plan.auto_interval`) with
  this run's measured blocking time C (rolling median), write time W (τ is never shorter),
  restart cost R (measured across restarts, else a drill, else a stated default) and job
  MTBF M = node MTBF / nodes, where the node MTBF is the user's prior updated by the
  failures this run has seen (:func:`posterior_node_mtbf`). Recomputed at start-up (so a
  resize changes M) and at every save.

Every rank must decide identically (a save is collective), so time is turned into steps:
at each save the decision says how many steps from now the next save comes
(:class:`Schedule`), from the measured time per step; ``should_save(step)`` is then a
comparison, the same on every rank, with no communication. The first save of a time-based
policy comes after ``calibration_steps`` steps, when the step time is first known.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.policy import plan
from tierckpt.policy.units import check_count, check_seconds, parse_duration

DEFAULT_NODE_MTBF_S = 30 * 86400.0
"""Node MTBF when none is given (30 days; large GPU fleets see 15–60): warned about."""
DEFAULT_RESTART_S = 300.0
"""Restart cost R before any restart was measured (5 minutes): stated as a default."""
CALIBRATION_STEPS = 20
"""Steps a time-based interval trains before its first save, to measure the step time."""


@dataclasses.dataclass(frozen=True)
class Every:
    """A fixed interval: exactly one of ``steps`` or ``seconds``."""

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ConfigError("Every(...) takes exactly one of steps= or seconds=, e.g. "
                              "Every(steps=500) or Every(seconds=600)")
        if self.steps is not None:
            check_count("steps", self.steps)
        if self.seconds is not None:
            check_seconds("seconds", self.seconds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoInterval:
    """Young/Daly from this run's measurements (see the module docstring).

    ``node_mtbf``: seconds or a duration (``"30d"``); None uses 30 days with a warning.
    ``restart``: R before one was measured (seconds or a duration; default 5 min).
    ``min_interval``/``max_interval``: clamp τ (defaults 60 s and 24 h).
    ``prior_failures``: how many failures the node-MTBF prior weighs (1: one failure at the
    prior rate; larger trusts the prior longer). ``calibration_steps``: steps before the
    first save, to measure the step time. ``rule``: ``young`` or ``daly``.
    """

    node_mtbf: float | str | None = None
    restart: float | str | None = None
    min_interval: float | str = 60.0
    max_interval: float | str = 86400.0
    prior_failures: float = 1.0
    calibration_steps: int = CALIBRATION_STEPS
    rule: str = "young"

    def __post_init__(self) -> None:
        for name in ("node_mtbf", "restart", "min_interval", "max_interval"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, parse_duration(
                    v, name, allow_zero=name in ("restart", "min_interval")))
        if float(self.min_interval) > float(self.max_interval):
            raise ConfigError(f"min_interval ({self.min_interval} s) is above max_interval "
                              f"({self.max_interval} s)")
        if not (isinstance(self.prior_failures, int | float) and self.prior_failures > 0):
            raise ConfigError(f"prior_failures must be > 0, got {self.prior_failures!r}")
        check_count("calibration_steps", self.calibration_steps)
        if self.rule not in {r.value for r in plan.Rule}:
            raise ConfigError(f"rule must be one of {[r.value for r in plan.Rule]}")


Policy = Every | AutoInterval


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What an auto decision is made from; each ``*_source`` is ``measured``, ``given`` or
    ``default`` (with the number of samples where measured)."""

    C: float
    W: float
    R: float
    node_mtbf: float
    nodes: int
    failures: int
    exposure_s: float
    C_source: str
    W_source: str
    R_source: str
    mtbf_source: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """An interval decision: τ in seconds, and what it was made from (for the
    ``interval_decided`` event)."""

    interval_s: float
    inputs: Inputs | None = None
    M_s: float | None = None
    """The job MTBF used (posterior node MTBF ÷ nodes)."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"interval_s": self.interval_s, "M_s": self.M_s}
        if self.inputs is not None:
            d["inputs"] = dataclasses.asdict(self.inputs)
        return d


def posterior_node_mtbf(i: Inputs, prior_failures: float = 1.0) -> float:
    """Node MTBF after this run's evidence: a Gamma prior worth ``prior_failures`` failures
    at the given rate, plus ``failures`` seen in ``exposure_s`` of job time on ``nodes``
    nodes (node exposure = job time × nodes). No failures seen leaves the prior's mean
    rising slowly with exposure; a flaky run pulls it down, so τ shrinks."""
    exposure_nodes = i.exposure_s * i.nodes
    return (prior_failures * i.node_mtbf + exposure_nodes) / (prior_failures + i.failures)


def median_recent(samples: Sequence[float], window: int = 9) -> float | None:
    """Median of the last ``window`` samples (None when there are none)."""
    recent = [s for s in samples[-window:] if math.isfinite(s) and s >= 0]
    return statistics.median(recent) if recent else None


def decide(policy: Policy, inputs: Inputs | None) -> Decision:
    """τ for ``policy`` (``inputs`` is needed for :class:`AutoInterval` only)."""
    if isinstance(policy, Every):
        return Decision(interval_s=float(policy.seconds or 0.0))
    assert inputs is not None
    M = posterior_node_mtbf(inputs, policy.prior_failures) / inputs.nodes
    tau = plan.auto_interval(max(inputs.C, 1e-3), M, W=inputs.W, rule=policy.rule,
                             min_s=float(policy.min_interval),
                             max_s=float(policy.max_interval))
    return Decision(interval_s=tau, inputs=inputs, M_s=M)


@dataclasses.dataclass
class Schedule:
    """Which step saves next, the same on every rank. ``next_step`` None: not yet known
    (before the first decision of a time-based policy: the calibration steps)."""

    policy: Policy
    next_step: int | None = None

    def should_save(self, step: int) -> bool:
        """Cheap; call every step with the step just completed."""
        if isinstance(self.policy, Every) and self.policy.steps is not None:
            return (step + 1) % self.policy.steps == 0
        return self.next_step is not None and step >= self.next_step

    def start(self, step: int) -> None:
        """At start-up (after a restore to ``step - 1``, or 0): time-based policies save
        first after their calibration steps."""
        if not (isinstance(self.policy, Every) and self.policy.steps is not None):
            calib = self.policy.calibration_steps if isinstance(self.policy, AutoInterval) \
                else CALIBRATION_STEPS
            self.next_step = step + calib - 1

    def after_save(self, step: int, interval_s: float, step_s: float | None) -> int | None:
        """The next save step after saving ``step``: τ ÷ the measured seconds per step
        (at least one step). Returns it (None for step-based policies)."""
        if isinstance(self.policy, Every) and self.policy.steps is not None:
            return None
        if step_s is None or step_s <= 0:
            self.next_step = step + 1
        else:
            self.next_step = step + max(1, round(interval_s / step_s))
        return self.next_step
