"""Monte Carlo simulation of a checkpointed job with failures, to check the analytic waste.

The model (one replica = one job):

- The job needs ``job_s`` seconds of training. It trains ``tau`` seconds, then blocks ``C``
  seconds staging a checkpoint, which becomes durable ``W`` seconds later (background write).
  If the write of the previous save is still running when the next is due (W > tau), the save
  waits for it, so a save starts every ``P = C + max(tau, W)`` seconds.
- Failures arrive as a renewal process in wall-clock time: gaps between failures are i.i.d.
  exponential (mean M) or Weibull (shape k, scaled so the mean is M). They strike whatever
  is happening: training, a save (that save is lost), a write (not durable yet: lost), or a
  restart (which starts again).
- After a failure the job pays ``R`` (detect, reschedule, reload, warm up), then resumes
  from the newest durable checkpoint. The first run starts without paying R. The job ends
  when its training is done; no final checkpoint is needed.

Vectorised over failures: the progress a run between two failures saves depends only on the
gap, so a whole chunk of gaps is processed with array operations and a cumulative sum; a
10-year job at M = 1 h (~90 000 failures) takes milliseconds per replica. Seeds are explicit
(``numpy.random.default_rng([seed, replica])``) and every interval of a sweep sees the same
failure times (common random numbers), which makes the sweep's curve smooth.

Waste is ``1 − job_s / E[wall time]``; the confidence interval comes from the normal
approximation for the mean wall time over replicas, mapped through that formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray

from tierckpt.errors import ConfigError
from tierckpt.policy import plan

__all__ = ["Failures", "JobModel", "SimResult", "Sweep", "simulate", "sweep"]


class Failures(str, Enum):
    """Distribution of the gaps between failures."""

    EXPONENTIAL = "exponential"
    WEIBULL = "weibull"


@dataclass(frozen=True, kw_only=True)
class JobModel:
    """A job to simulate. Seconds throughout; ``shape`` is used only for Weibull failures
    (below 1: failures cluster, as with infant mortality; 1: exponential)."""

    C: float
    M: float
    job_s: float
    R: float = 0.0
    W: float = 0.0
    failures: Failures = Failures.EXPONENTIAL
    shape: float = 1.0

    def __post_init__(self) -> None:
        for name in ("C", "M", "job_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("R", "W"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be zero or positive seconds, got {v!r}")
        if self.C >= self.M:
            raise ConfigError(f"C ({self.C:g} s) must be smaller than M ({self.M:g} s)")
        object.__setattr__(self, "failures", Failures(self.failures))
        if not (math.isfinite(self.shape) and self.shape > 0):
            raise ConfigError(f"shape must be a positive number, got {self.shape!r}")


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Simulated waste at one interval, with its confidence interval and the analytic values
    (``analytic_first_order`` = C/tau + (tau/2 + W)/M + R/M; ``analytic_exact`` = the exact
    long-run value for exponential failures, :func:`tierckpt.policy.plan.exact_waste`)."""

    interval_s: float
    replicas: int
    confidence: float
    waste_fraction: float
    ci_low: float
    ci_high: float
    analytic_first_order: float
    analytic_exact: float
    wall_s_mean: float
    failures_mean: float
    failures_in_save_mean: float
    failures_in_restart_mean: float

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies inside the confidence interval."""
        return self.ci_low <= value <= self.ci_high


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """Simulations over several intervals; ``best`` has the lowest simulated waste."""

    results: tuple[SimResult, ...]
    best: SimResult


def simulate(model: JobModel, interval_s: float, *, replicas: int = 200, seed: int = 0,
             confidence: float = 0.95) -> SimResult:
    """Simulate ``replicas`` independent runs of ``model`` checkpointing every ``interval_s``
    training seconds. Deterministic for a given ``seed``."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ConfigError(f"interval must be a positive number of seconds, got {interval_s!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
        raise ConfigError(f"replicas must be an integer >= 2, got {replicas!r}")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be between 0 and 1, got {confidence!r}")
    walls = np.empty(replicas)
    counts = np.zeros((replicas, 3))
    for i in range(replicas):
        rng = np.random.default_rng([seed, i])
        walls[i], counts[i] = _run_one(model, interval_s, rng)
    mean = float(walls.mean())
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * float(walls.std(ddof=1)) / math.sqrt(
        replicas)
    m = model
    return SimResult(
        interval_s=interval_s, replicas=replicas, confidence=confidence,
        waste_fraction=1.0 - m.job_s / mean,
        ci_low=1.0 - m.job_s / max(mean - half, m.job_s),
        ci_high=1.0 - m.job_s / (mean + half),
        analytic_first_order=plan.waste(m.C, interval_s, m.M, m.R, W=m.W).total,
        analytic_exact=plan.exact_waste(m.C, interval_s, m.M, m.R, W=m.W),
        wall_s_mean=mean, failures_mean=float(counts[:, 0].mean()),
        failures_in_save_mean=float(counts[:, 1].mean()),
        failures_in_restart_mean=float(counts[:, 2].mean()))


def sweep(model: JobModel, intervals: Sequence[float] | None = None, *, points: int = 25,
          replicas: int = 100, seed: int = 0, confidence: float = 0.95) -> Sweep:
    """Simulate each interval (default: ``points`` log-spaced from Young/8 to Young·8, kept
    below M) with the same failure times, and pick the one with the lowest waste."""
    if intervals is None:
        if points < 2:
            raise ConfigError(f"points must be >= 2, got {points}")
        young = plan.young_interval(model.C, model.M)
        hi = min(young * 8.0, model.M)
        intervals = [float(x) for x in np.geomspace(young / 8.0, max(hi, young), points)]
    if not intervals:
        raise ConfigError("sweep: give at least one interval")
    results = tuple(simulate(model, t, replicas=replicas, seed=seed, confidence=confidence)
                    for t in intervals)
    return Sweep(results=results, best=min(results, key=lambda r: r.waste_fraction))


# ---------------------------------------------------------------------------- core


def _gaps(model: JobModel, rng: np.random.Generator, n: int) -> NDArray[np.float64]:
    if model.failures is Failures.EXPONENTIAL:
        return rng.exponential(model.M, n)
    scale = model.M / math.gamma(1.0 + 1.0 / model.shape)
    return rng.weibull(model.shape, n) * scale


def _run_one(model: JobModel, tau: float, rng: np.random.Generator
             ) -> tuple[float, NDArray[np.float64]]:
    """Wall time of one job and its failure counts (total, during a save, during a restart).

    For each run between failures: ``run`` = gap − restart cost; checkpoint j (0-based)
    stages during [tau + jP, tau + jP + C) and is durable at tau + jP + C + W; the job
    finishes in the first run that is long enough for the work still to do. Written as a
    few whole-array passes (this loop is the simulator's cost).
    """
    C, R, W, T = model.C, model.R, model.W, model.job_s
    P = C + max(tau, W)
    # Chunk size depends only on the model, so every interval sees the same failure times.
    n = min(int(1.2 * T / model.M) + 64, 1 << 20)
    saved, elapsed, first = 0.0, 0.0, True
    counts = np.zeros(3)
    while True:
        g = _gaps(model, rng, n)
        run = g - R
        if first:
            run[0] = g[0]  # the job's first run pays no restart
        # checkpoints made durable in each run: max(floor((run - tau - C - W)/P) + 1, 0)
        q = (run - (tau + C + W)) / P
        durable = np.floor(q)
        durable += 1.0
        np.maximum(durable, 0.0, out=durable)
        cum = np.cumsum(durable)
        # a run can only finish the job if it is at least as long as the work left
        left = (T - saved) - tau * (cum - durable)
        j = n
        for i in np.flatnonzero(run >= left):
            if run[i] >= _time_to_finish(float(left[i]), tau, C, P):
                j = int(i)
                break
        head = q[:j] + (C + W) / P  # (run - tau)/P: a save was in progress if floors differ
        counts += np.array([j, np.count_nonzero((head >= 0) & (np.floor(head) > durable[:j] - 1)),
                            np.count_nonzero(run[:j] < 0)], dtype=np.float64)
        if j < n:
            restart = 0.0 if first and j == 0 else R
            return elapsed + float(g[:j].sum()) + restart + _time_to_finish(
                float(left[j]), tau, C, P), counts
        elapsed += float(g.sum())
        saved += tau * float(cum[-1])
        first = False


def _time_to_finish(work: float, tau: float, C: float, P: float) -> float:
    """Seconds a run needs for ``work`` more training: k = ceil(work/tau) − 1 saves on the
    way (the first after tau + C, then one every P), then the remainder; no final save."""
    k = max(math.ceil(work / tau) - 1, 0)
    return work if k == 0 else tau + C + (k - 1) * P + (work - k * tau)
