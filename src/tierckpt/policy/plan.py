"""Checkpoint planning arithmetic: sizing, job MTBF, the checkpoint interval and its waste.

Pure functions of values (no I/O, no torch), so the CLI and ``CheckpointManager(interval=
"auto")`` can call them at run time. Units: seconds as ``float``, bytes as ``int``.

Symbols (as in DESIGN.md, "The problem in numbers"):

- ``C`` — seconds training is blocked per checkpoint (staging; measured as ``save_staged``).
- ``W`` — seconds from the end of staging until the checkpoint is durable (background write).
- ``R`` — restart cost per failure: detect, reschedule, reload, warm up.
- ``M`` — job MTBF = node MTBF / nodes.
- ``tau`` — training seconds between checkpoints (the time between two ``save()`` calls is
  ``tau + C``).

First-order model (Young 1974): ``waste ≈ C/tau + (tau/2 + W)/M + R/M`` (for tau ≥ W) with
optimum ``tau = sqrt(2·C·M)``; ``W`` is zero in the classic form and adds to the rework because a
failure before the latest save is durable rolls back one interval further. Daly (2006) gives
a higher-order optimum. :func:`exact_waste` is the exact long-run waste for exponential
failures with failures during saves and restarts (the model ``tierckpt.policy.simulate`` simulates);
it shows where the first-order formula stops being accurate (C, R or tau not small against M).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from tierckpt.errors import ConfigError
from tierckpt.policy.units import check_count

_E = TypeVar("_E", bound=Enum)

__all__ = [
    "BytesPerParam", "CheckpointSize", "IntervalPlan", "Optimizer", "RamFit", "Rule",
    "Strategy", "WasteBreakdown", "Weights", "auto_interval", "best_exact_interval",
    "bytes_per_param", "checkpoint_size", "compare", "daly_interval", "exact_waste",
    "job_mtbf", "node_days_per_month", "plan_interval", "resolve_job_mtbf", "staging_fit",
    "waste", "write_time", "young_interval",
]

DAYS_PER_MONTH = 30.0
"""A month, for "node-days per month", is 30 days."""


# ----------------------------------------------------------------------------- sizing


class Optimizer(str, Enum):
    """Optimizer whose state is checkpointed; its value is the number of fp32 moments."""

    ADAM = "adam"
    ADAMW = "adamw"
    SGD_MOMENTUM = "sgd-momentum"
    SGD = "sgd"


class Weights(str, Enum):
    """dtype of the model weights as trained."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


_MOMENTS = {Optimizer.ADAM: 2, Optimizer.ADAMW: 2, Optimizer.SGD_MOMENTUM: 1, Optimizer.SGD: 0}
_WEIGHT_BYTES = {Weights.BF16: 2, Weights.FP16: 2, Weights.FP32: 4}


@dataclass(frozen=True, kw_only=True)
class BytesPerParam:
    """Checkpoint bytes per parameter, by part. ``total`` = weights + master + optimizer."""

    weights: int
    master: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.master + self.optimizer


def bytes_per_param(*, optimizer: Optimizer | str = Optimizer.ADAM,
                    weights: Weights | str = Weights.BF16,
                    master_fp32: bool = True) -> BytesPerParam:
    """Bytes per parameter: weights (2 for bf16/fp16, 4 for fp32), an fp32 master copy (4,
    only when the weights are not already fp32) and 4 per fp32 optimizer moment (Adam: 2).

    Mixed precision with Adam is 14; without the bf16 copy (fp32 weights) it is 12.
    """
    opt = _enum(Optimizer, optimizer, "optimizer")
    w = _enum(Weights, weights, "weights")
    master = 4 if master_fp32 and w is not Weights.FP32 else 0
    return BytesPerParam(weights=_WEIGHT_BYTES[w], master=master, optimizer=4 * _MOMENTS[opt])


@dataclass(frozen=True, kw_only=True)
class CheckpointSize:
    """A full checkpoint's size and each node's and rank's share (even sharding)."""

    params: int
    per_param: BytesPerParam
    extra_bytes: int
    total_bytes: int
    nodes: int
    gpus_per_node: int
    per_node_bytes: int
    per_rank_bytes: int


def checkpoint_size(params: int, *, optimizer: Optimizer | str = Optimizer.ADAM,
                    weights: Weights | str = Weights.BF16, master_fp32: bool = True,
                    extra_bytes: int = 0, nodes: int = 1,
                    gpus_per_node: int = 1) -> CheckpointSize:
    """Size of a checkpoint of ``params`` parameters plus ``extra_bytes`` of other state
    (data loader, RNG, scheduler), split evenly over ``nodes × gpus_per_node`` ranks
    (shares rounded up). 70e9 params with the defaults → 980 GB."""
    check_count("params", params)
    check_count("nodes", nodes)
    check_count("gpus_per_node", gpus_per_node)
    if extra_bytes < 0:
        raise ConfigError(f"extra_bytes must be >= 0, got {extra_bytes}")
    bpp = bytes_per_param(optimizer=optimizer, weights=weights, master_fp32=master_fp32)
    total = params * bpp.total + extra_bytes
    return CheckpointSize(params=params, per_param=bpp, extra_bytes=extra_bytes,
                          total_bytes=total, nodes=nodes, gpus_per_node=gpus_per_node,
                          per_node_bytes=-(-total // nodes),
                          per_rank_bytes=-(-total // (nodes * gpus_per_node)))


@dataclass(frozen=True, kw_only=True)
class RamFit:
    """Whether a node's pinned staging buffers fit in host RAM beside a reserve.

    ``margin_bytes`` = RAM − reserve − staging; negative means it does not fit.
    """

    node_ram_bytes: int
    reserve_bytes: int
    staging_bytes: int
    margin_bytes: int

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0


def staging_fit(per_node_bytes: int, node_ram_bytes: int, reserve_bytes: int) -> RamFit:
    """Staging holds one copy of the node's share (one save in flight, reused buffers)."""
    check_count("node_ram_bytes", node_ram_bytes)
    if reserve_bytes < 0 or per_node_bytes < 0:
        raise ConfigError("per_node_bytes and reserve_bytes must be >= 0")
    margin = node_ram_bytes - reserve_bytes - per_node_bytes
    return RamFit(node_ram_bytes=node_ram_bytes, reserve_bytes=reserve_bytes,
                  staging_bytes=per_node_bytes, margin_bytes=margin)


def write_time(nbytes: int, bytes_per_s: float) -> float:
    """Seconds to write ``nbytes`` at ``bytes_per_s`` (122.5 GB at 4 GB/s → 30.6 s)."""
    if not bytes_per_s > 0:
        raise ConfigError(f"bandwidth must be > 0 bytes/s, got {bytes_per_s}")
    return nbytes / bytes_per_s


# ----------------------------------------------------------------------- failure rate


def job_mtbf(node_mtbf: float, nodes: int) -> float:
    """Job MTBF in seconds: a job fails when any of its ``nodes`` fails."""
    _positive(node_mtbf, "node_mtbf")
    check_count("nodes", nodes)
    return node_mtbf / nodes


def resolve_job_mtbf(*, job_mtbf_s: float | None = None, node_mtbf_s: float | None = None,
                     nodes: int | None = None) -> float:
    """The job MTBF from exactly one source: ``job_mtbf_s``, or ``node_mtbf_s`` with ``nodes``.

    The error names the missing or conflicting argument (CLI flags use the same names).
    """
    if job_mtbf_s is not None and node_mtbf_s is not None:
        raise ConfigError("give either job-mtbf or node-mtbf (with nodes), not both")
    if job_mtbf_s is not None:
        return _positive(job_mtbf_s, "job-mtbf")
    if node_mtbf_s is not None:
        if nodes is None:
            raise ConfigError("node-mtbf needs nodes: job MTBF = node MTBF / nodes")
        return job_mtbf(node_mtbf_s, nodes)
    raise ConfigError("missing MTBF: give job-mtbf, or node-mtbf with nodes")


def node_days_per_month(waste_fraction: float, nodes: int) -> float:
    """Node-days lost per 30-day month when ``nodes`` nodes waste ``waste_fraction``."""
    return waste_fraction * nodes * DAYS_PER_MONTH


# ------------------------------------------------------------------------ interval


def young_interval(C: float, M: float) -> float:
    """Young's first-order optimum ``sqrt(2·C·M)`` (M = 12 h, C = 60 s → 2277 s ≈ 38 min)."""
    _check_cm(C, M)
    return math.sqrt(2.0 * C * M)


def daly_interval(C: float, M: float) -> float:
    """Daly's (2006) higher-order optimum:
    ``sqrt(2CM)·[1 + (1/3)·sqrt(C/2M) + (1/9)·(C/2M)] − C`` for C < 2M (we require C < M)."""
    _check_cm(C, M)
    x = C / (2.0 * M)
    return math.sqrt(2.0 * C * M) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - C


@dataclass(frozen=True)
class WasteBreakdown:
    """Expected fraction of wall time lost, by cause (first-order model).

    ``ckpt`` = C/tau (blocked saving; (C + W − tau)/tau when tau < W, because each save
    then also waits for the previous write), ``rework`` = (tau/2 + W)/M (recomputing lost
    work), ``restart`` = R/M (restarting), ``total`` = their sum.
    """

    ckpt: float
    rework: float
    restart: float
    total: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.ckpt + self.rework + self.restart)


def waste(C: float, tau: float, M: float, R: float = 0.0, *, W: float = 0.0) -> WasteBreakdown:
    """First-order waste ``C/tau + (tau/2 + W)/M + R/M`` (Young; W = 0 gives the classic form;
    for tau < W the blocked term becomes (C + W − tau)/tau, see :class:`WasteBreakdown`).

    Accurate while C, R, W and tau are small against M; see :func:`exact_waste` otherwise.
    """
    _check_cm(C, M)
    _positive(tau, "tau")
    _nonneg(R, "R")
    _nonneg(W, "W")
    blocked = C + max(0.0, W - tau)  # with tau < W each save also waits for the last write
    return WasteBreakdown(ckpt=blocked / tau, rework=(tau / 2.0 + W) / M, restart=R / M)


def exact_waste(C: float, tau: float, M: float, R: float = 0.0, *, W: float = 0.0) -> float:
    """Exact long-run waste fraction for exponential failures (rate 1/M) of a job that runs
    forever, with failures possible during saves, writes and restarts:

        1 − tau·exp(−(R + tau + C + W)/M) / (M·(1 − exp(−P/M))),   P = C + max(tau, W)

    A failure rolls back to the newest *durable* checkpoint (staged and then written for W);
    a failure during a restart starts the restart again; when W > tau a save waits for the
    previous write (period P). With W = 0 this is Daly's (2006) complete model. It is what
    ``tierckpt.policy.simulate`` should reproduce for long exponential jobs.
    """
    _check_cm(C, M, allow_large=True)
    _positive(tau, "tau")
    _nonneg(R, "R")
    _nonneg(W, "W")
    period = C + max(tau, W)
    work = tau * math.exp(-(R + tau + C + W) / M) / (M * -math.expm1(-period / M))
    return 1.0 - work


def best_exact_interval(C: float, M: float, R: float = 0.0, *, W: float = 0.0) -> float:
    """The tau minimising :func:`exact_waste` (golden-section search on log tau)."""
    _check_cm(C, M, allow_large=True)
    lo, hi = math.log(math.sqrt(2.0 * C * M) / 100.0), math.log(20.0 * M)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo + (1 - g) * (hi - lo), lo + g * (hi - lo)
    fa, fb = (exact_waste(C, math.exp(a), M, R, W=W), exact_waste(C, math.exp(b), M, R, W=W))
    for _ in range(200):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - g) * (hi - lo)
            fa = exact_waste(C, math.exp(a), M, R, W=W)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = exact_waste(C, math.exp(b), M, R, W=W)
        if hi - lo < 1e-9:
            break
    return math.exp((lo + hi) / 2.0)


class Rule(str, Enum):
    """Which optimum to recommend."""

    YOUNG = "young"
    DALY = "daly"


@dataclass(frozen=True, kw_only=True)
class IntervalPlan:
    """A recommended interval for one set of inputs and what it costs.

    ``interval_s`` is tau by ``rule``; ``waste`` is the first-order breakdown at it and
    ``exact_waste_fraction`` the exponential-failure exact value. ``overlap`` is true when
    tau < W: saves would overlap (the next save waits), so use faster storage or a longer
    interval.
    """

    name: str
    C: float
    R: float
    W: float
    M: float
    rule: Rule
    young_s: float
    daly_s: float
    interval_s: float
    waste: WasteBreakdown
    exact_waste_fraction: float
    overlap: bool


def plan_interval(C: float, M: float, R: float = 0.0, *, W: float = 0.0,
                  rule: Rule | str = Rule.YOUNG, name: str = "") -> IntervalPlan:
    """Young and Daly intervals for (C, M), the waste at the interval ``rule`` picks, and
    whether saves would overlap. Raises ConfigError for C ≤ 0, C ≥ M, R < 0 or W < 0."""
    _check_cm(C, M)
    _nonneg(R, "R")
    _nonneg(W, "W")
    r = _enum(Rule, rule, "rule")
    young, daly = young_interval(C, M), daly_interval(C, M)
    tau = young if r is Rule.YOUNG else daly
    return IntervalPlan(name=name, C=C, R=R, W=W, M=M, rule=r, young_s=young, daly_s=daly,
                        interval_s=tau, waste=waste(C, tau, M, R, W=W),
                        exact_waste_fraction=exact_waste(C, tau, M, R, W=W), overlap=tau < W)


def auto_interval(C: float, M: float, *, W: float = 0.0, rule: Rule | str = Rule.YOUNG,
                  min_s: float = 0.0, max_s: float = math.inf) -> float:
    """The interval of ``CheckpointManager(interval=AutoInterval())``: the ``rule`` optimum
    from the measured C (and W), never shorter than W (one save in flight: a shorter interval would
    only make ``save()`` wait) and clamped to ``[min_s, max_s]``."""
    tau = plan_interval(C, M, W=W, rule=rule).interval_s
    return min(max(tau, W, min_s), max_s)


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A way of checkpointing to compare: its blocking C, restart R and write time W."""

    name: str
    C: float
    R: float
    W: float = 0.0


def compare(strategies: Sequence[Strategy], M: float,
            rule: Rule | str = Rule.YOUNG) -> list[IntervalPlan]:
    """One :class:`IntervalPlan` per strategy at the same job MTBF, in the given order.

    DESIGN.md's example: M = 12 h; sync C = 60 s, R = 15 min → 38 min, 7.4 %; async C = 5 s,
    R = 5 min → 11 min, 2.2 %.
    """
    if not strategies:
        raise ConfigError("compare: give at least one strategy")
    return [plan_interval(s.C, M, s.R, W=s.W, rule=rule, name=s.name) for s in strategies]


# ---------------------------------------------------------------------- validation


def _positive(x: float, name: str) -> float:
    if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, got {x!r}")
    return float(x)


def _nonneg(x: float, name: str) -> float:
    if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
        raise ConfigError(f"{name} must be zero or a positive number of seconds, got {x!r}")
    return float(x)


def _check_cm(C: float, M: float, *, allow_large: bool = False) -> None:
    _positive(C, "C (blocking time per checkpoint)")
    _positive(M, "M (job MTBF)")
    if C >= M and not allow_large:
        raise ConfigError(
            f"C (blocking time, {C:g} s) must be smaller than M (job MTBF, {M:g} s): "
            "checkpointing cannot keep up with failures; make saves faster or the job smaller")


def _enum(kind: type[_E], value: object, name: str) -> _E:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise ConfigError(f"{name}: unknown value {value!r}; choose one of {choices}") from None
