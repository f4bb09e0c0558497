"""The chaos drill's value types: what to drill, how long it waits, and what it records.

:class:`ChaosConfig` is the validated input of :func:`tierckpt.drill.chaos.run_chaos`
(ConfigError for bad input, raised on construction). The timing constants bound every wait
of the drill. :class:`StartRecord` and :class:`CycleRecord` are the mutable records the
runner (:mod:`tierckpt.drill.chaos_state` and its subclasses) fills in: one per start of the
job, one per fault cycle; the report's cycle records are made from the latter. Nothing here
touches a file or a process.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.job import DrillJob, check_steps
from tierckpt.drill.launch import Job
from tierckpt.errors import ConfigError

__all__ = ["HOLD_FULL_S", "JOB_TIMEOUT_PER_STEP_S", "JOB_TIMEOUT_S", "MOMENT_S",
           "PRECONDITION_S", "QUIET_S", "SAMPLE_S", "SETTLE_S", "STAGES", "STEPS_PER_CYCLE",
           "UPLOAD_MOMENT_S", "ChaosConfig", "CycleRecord", "StartRecord"]

STAGES = ("reference", "chaos", "final")
"""What :func:`tierckpt.drill.chaos.run_chaos` reports progress for (then ``report``)."""
STEPS_PER_CYCLE = 150
"""Default ``steps`` per cycle: room for a cycle's commits and its time-based waits (an
upload to happen, tier 2 to be missed) at a few dozen steps per second, saving every 10."""
SETTLE_S = 30.0  # a job whose rank was killed exits on its own within this, else is stopped
QUIET_S = 30.0  # its processes (uploaders draining a file) exit within this, else are killed
MOMENT_S = 15.0  # longest wait for a kill's moment (a save) before killing anyway
UPLOAD_MOMENT_S = 5.0  # longest wait for an upload to start (the uploader polls every 2 s)
HOLD_FULL_S = 60.0  # longest a full tier 1 is held while the job runs on
PRECONDITION_S = 30.0  # longest wait for what an at-rest fault needs (a tier-2 copy)
SAMPLE_S = 0.05  # how often tier-1 step directories are counted
JOB_TIMEOUT_S = 600.0
"""The fixed part of the default bound on one uninterrupted run of the command."""
JOB_TIMEOUT_PER_STEP_S = 0.2
"""Its part per training step: 5 steps/s at the least (the example with tier 0 runs about 14
on 2 cores; a fixed 600 s stopped the reference of a 60-cycle run at step 8700 of 9150)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosConfig(DrillJob):
    """What to drill: the job (:class:`~tierckpt.drill.job.DrillJob`: ``command`` on ``nnodes``
    simulated nodes of ``nproc`` ranks, ``seed``, ``tier2``, ``rtol``) through ``cycles``
    fault cycles drawn from ``seed`` over ``kinds``. ``steps`` defaults to
    :data:`STEPS_PER_CYCLE` per cycle (plus one cycle's worth). ``tmpfs``: put each node
    root on a size-limited tmpfs (needs root; without it the full-tier-1 fault is left out).
    ``tier0``: run the job with tier 0 — ``"auto"`` (``Tier0()``: each node's RAM at its
    default location) or a directory on tmpfs (node i of run r gets
    ``<tier0>/<r>-node<i>``), passed to the command as ``--tier0``; None (the default) runs
    without it, unless the command itself names ``--tier0 VALUE``, which is then taken as
    this setting. Without tier 0 the RAM faults are left out. ``preempt``: add the
    termination-notice kinds (:data:`~tierckpt.drill.chaos_verdicts.NOTICE_KINDS`) to the
    catalogue; without it they are left out (and a seed draws the plan it drew before they
    existed). The command must call ``CheckpointManager.should_stop`` each step. ``heal``:
    run the job under ``tierckpt run`` (the heal launcher, one node of ``nproc`` >= 3 ranks,
    two pre-warmed spares) and add ``heal_kill``
    (:data:`~tierckpt.drill.chaos_verdicts.HEAL_OUTCOMES`) to the catalogue; a plain
    ``kill_rank`` then heals, so it is left out, and an at-rest fault takes the node down by
    killing the launcher with everything it started. The command must heal as
    examples/train.py does (``CheckpointManager.heal``). ``dedup``: add the faults of tier 2's
    content objects (:data:`~tierckpt.drill.chaos_verdicts.OBJECT_KINDS`; a ``file://`` tier
    2) and the ``tier2`` invariant; without it they are left out. ``job_timeout_s`` bounds one
    uninterrupted run of the command (the reference, the last start's training to the end);
    None: :data:`JOB_TIMEOUT_S` plus :data:`JOB_TIMEOUT_PER_STEP_S` per step, since both
    train every step. ``commit_timeout_s`` bounds how long a start may take to restore and
    commit; ``max_starts`` how often a cycle starts the job again before the drill gives up."""

    USAGE = "tierckpt drill --chaos 10 -- python examples/train.py"

    cycles: int
    nnodes: int = 2
    nproc: int = 1
    steps: int | None = None
    kinds: tuple[str, ...] = cv.KINDS
    tmpfs: bool = True
    tier0: str | None = None
    preempt: bool = False
    heal: bool = False
    dedup: bool = False
    job_timeout_s: float | None = None
    commit_timeout_s: float = 180.0
    max_starts: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "kinds", tuple(self.kinds))
        object.__setattr__(self, "tier0", _tier0_setting(self.tier0, self.command))
        for name, flag in (("cycles", "--chaos"), ("max_starts", "max_starts")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{flag} must be an int >= 1, got {v!r}")
        if self.heal:
            _check_heal(self)
        elif self.nnodes < 2:
            raise ConfigError(f"the chaos drill needs --nnodes >= 2 (node-local roots, partial "
                              f"commits across nodes), got {self.nnodes!r}")
        cv.draw_plan(0, 1, nodes=self.nnodes, kinds=self.kinds)  # validates the kinds
        if self.steps is None:
            object.__setattr__(self, "steps", STEPS_PER_CYCLE * (self.cycles + 1))
        else:
            check_steps(self.steps)
        if self.job_timeout_s is None:
            object.__setattr__(self, "job_timeout_s",
                               JOB_TIMEOUT_S + JOB_TIMEOUT_PER_STEP_S * self.total_steps)
        elif not self.job_timeout_s > 0:
            raise ConfigError(f"job_timeout_s must be seconds > 0, got {self.job_timeout_s!r}")

    @property
    def tier0_on(self) -> bool:
        return self.tier0 is not None

    @property
    def total_steps(self) -> int:
        assert self.steps is not None
        return self.steps

    @property
    def run_timeout_s(self) -> float:
        """``job_timeout_s``, resolved."""
        assert self.job_timeout_s is not None
        return self.job_timeout_s


def _check_heal(cfg: ChaosConfig) -> None:
    """``--chaos N --heal``: one node (the heal launcher supervises one node; multi-node
    heals are not built), at least 3 ranks (two die at once and one must survive), no tier
    0 (its partner ring needs two nodes)."""
    if cfg.nnodes != 1:
        raise ConfigError(f"--chaos with --heal runs the job on one node under `tierckpt run` "
                          f"(multi-node heals are not built): give --nnodes 1 or leave it out, "
                          f"got {cfg.nnodes!r}")
    if cfg.nproc < 3:
        raise ConfigError(f"--chaos with --heal needs --nproc >= 3 (two ranks die at once and "
                          f"one must survive), got {cfg.nproc}")
    if cfg.tier0 is not None:
        raise ConfigError("--chaos with --heal runs without tier 0 (its replica goes to a "
                          "partner node, and the heal job has one node): drop --tier0")


def _tier0_setting(given: str | os.PathLike[str] | None, command: tuple[str, ...]
                   ) -> str | None:
    """``"auto"``, an absolute directory, or None; the command's own ``--tier0 VALUE`` (the
    last one, as argparse reads it) when none is given. ConfigError when both are given and
    differ, or for an empty value."""
    named = None
    for i, arg in enumerate(command):
        if arg == "--tier0" and i + 1 < len(command):
            named = command[i + 1]
        elif arg.startswith("--tier0="):
            named = arg.split("=", 1)[1]
    values = {_norm_tier0(v) for v in (os.fspath(given) if given is not None else None, named)
              if v is not None}
    if len(values) > 1:
        raise ConfigError(f"the drill's --tier0 {given} and the command's --tier0 {named} "
                          "differ; give it once")
    return values.pop() if values else None


def _norm_tier0(value: str) -> str:
    if not value:
        raise ConfigError("--tier0 must be 'auto' or a directory on tmpfs, got ''")
    return value if value == "auto" else str(Path(value).expanduser().absolute())


@dataclasses.dataclass
class StartRecord:
    """One start of the job and what the drill knew when it launched it: per node, the
    complete tier-1 steps, the drill-damaged ones among them, and the steps it could
    restore from RAM (:func:`tierckpt.drill.chaos_verdicts.ram_restorable`; empty without
    tier 0) with the RAM copies the drill damaged."""

    index: int
    cycle: int
    job: Job
    losses: Path
    t_launch: float
    marks: list[int]  # per node: index of the first event of this start in its tail
    complete: dict[int, set[int]]
    broken: dict[int, set[int]]
    views: list[frozenset[int] | None]  # tier-2 steps seen while it restored (None: down)
    ram: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    ram_damaged: dict[int, set[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    t2_broken: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    """Per node, the tier-2 steps whose content object of that node's files the drill
    damaged (``--dedup``), as they were when it started."""
    restored: int | None = None
    checked: bool = False
    end: str = "running"
    rc: int | None = None
    excused: str | None = None
    t_commit: float | None = None


@dataclasses.dataclass
class CycleRecord:
    """What one cycle did and found (the report's cycle record is made from it)."""

    plan: cv.CyclePlan | None
    index: int
    faults: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    verdicts: list[cv.Verdict] = dataclasses.field(default_factory=list)
    starts: list[int] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    peaks: dict[int, int] = dataclasses.field(default_factory=dict)
    resumed: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    t_fault: float | None = None
    recovery_s: float | None = None
    prev: int | None = None  # the start running when the cycle began
    ended_by_fault: bool = False
