"""A run's goodput from its own events: where the wall time went, across every restart.
Pure: a list of event records (``tierckpt.runtime.events``) in, a :class:`Goodput` out.

The run is cut into incarnations (one per rank-0 process, in start order, and one more
after each heal that kept rank 0's process: ``heal_begin`` ends one and starts the next).
For each:

- **start-up**: process start → its first training step (the first incarnation only; later
  ones count it as restart);
- **restart**: the previous incarnation's last sign of life (or its ``failure_detected``,
  when earlier) → this incarnation's first step — detection, rescheduling, process start,
  restore, warm-up;
- **blocked**: ``save_staged`` seconds (C), and **overlap**: ``overlap`` seconds (a save
  waiting for the previous one);
- **slowed**: steps that ran slower while a save copied and wrote in the background
  (``save_cost`` seconds above that save's C, :mod:`tierckpt.runtime.save_cost`);
- each of these three per save at its slowest rank (the others wait for it in the next
  step's collectives);
- **lost work**: the steps an incarnation computed beyond the step the next one resumed
  from (``restore_done``), at that incarnation's measured seconds per step;
- **productive**: the rest of its training time.

Each incarnation also says which run of the job it was: torchrun's restart count and, under
a scheduler, the job's id and the scheduler's requeue (or JobSet restart) count, from its
``process_start``.

An incarnation that ends with ``preempt_saved`` (rank 0's, naming at least one tier reached)
was *announced*: a notice came, every rank stopped at the agreed step and the emergency save
committed. Its training ends at ``preempt_stop``; the emergency save's carry after it counts
as restart. Every other end but the last is *unannounced* (a failure: a kill, a crash, a
hang). :attr:`Goodput.failures`, R and the observed M count the unannounced ones only; each
:class:`Interruption` has its kind, lost work and restart time.

The parts sum to the wall time (first event → last event); ``unaccounted`` holds what a
gap between incarnations leaves over. The model's prediction for the same C, R, τ and M
(:func:`tierckpt.policy.plan.waste`) is reported beside the measured waste.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from tierckpt.policy import costs, plan

CATEGORIES = ("productive", "blocked", "slowed", "overlap", "lost_work", "restart",
              "startup", "unaccounted")
KINDS = ("announced", "unannounced")


def saved_preemption(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` says an emergency save committed on a notice: ``preempt_saved``
    with a non-empty ``reached`` (the tiers that hold it). The one test of "announced"
    that the report and the auto interval's failure count share."""
    reached = record.get("reached")
    return record.get("event") == "preempt_saved" and isinstance(reached, list) \
        and bool(reached)


@dataclasses.dataclass(frozen=True)
class Incarnation:
    pid: int
    start: float
    first_step_t: float | None
    end: float
    first_step: int | None
    last_step: int | None
    resumed_from: int | None  # the step restore() loaded, None on a fresh start
    failure_t: float | None
    stop_t: float | None = None  # its preempt_stop: training ended at the agreed step
    announced: bool = False  # it ended with a committed emergency save (saved_preemption)
    restart_count: int | None = None  # torchrun's restarts before it (process_start)
    scheduler: str | None = None  # slurm | kubernetes (process_start.scheduler), else None
    job_id: str | None = None  # the scheduler's job id
    requeue: int | None = None  # the scheduler's runs of the job before this one (requeues)


@dataclasses.dataclass(frozen=True)
class Interruption:
    """The end of one incarnation and the start of the next: ``kind`` ``announced`` or
    ``unannounced``; ``at_t`` when training ended (the agreed stop, the failure's
    detection, else the last sign of life); the work computed past the step the next one
    resumed from (``lost_steps``, ``lost_work_s``); ``restart_s`` from ``at_t`` to the next
    incarnation's first step."""

    kind: str
    at_t: float
    lost_steps: int
    lost_work_s: float
    restart_s: float


@dataclasses.dataclass(frozen=True)
class Goodput:
    """Seconds per category (:data:`CATEGORIES`), their sum ``wall_s``, counts and the
    model's prediction (None when there was no failure and no given MTBF to predict with)."""

    wall_s: float
    seconds: dict[str, float]
    incarnations: tuple[Incarnation, ...]
    failures: int
    saves: int
    interval_s: float | None
    C_s: float | None
    R_s: float | None
    M_s: float | None
    predicted_waste: float | None
    interruptions: tuple[Interruption, ...] = ()

    @property
    def announced(self) -> int:
        """Interruptions announced by a notice whose emergency save committed."""
        return sum(1 for i in self.interruptions if i.kind == "announced")

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Per kind (:data:`KINDS`): ``count``, ``lost_steps``, ``lost_work_s``,
        ``restart_s`` (sums over the kind's interruptions)."""
        out = {k: {"count": 0.0, "lost_steps": 0.0, "lost_work_s": 0.0, "restart_s": 0.0}
               for k in KINDS}
        for i in self.interruptions:
            row = out[i.kind]
            row["count"] += 1
            row["lost_steps"] += i.lost_steps
            row["lost_work_s"] += i.lost_work_s
            row["restart_s"] += i.restart_s
        return out

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def waste(self) -> float:
        return 1.0 - self.goodput

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "seconds": dict(self.seconds),
                "fractions": {k: (v / self.wall_s if self.wall_s else 0.0)
                              for k, v in self.seconds.items()},
                "goodput": self.goodput, "waste": self.waste, "failures": self.failures,
                "saves": self.saves, "interval_s": self.interval_s, "C_s": self.C_s,
                "R_s": self.R_s, "M_s": self.M_s, "predicted_waste": self.predicted_waste,
                "announced": self.announced,
                "interruptions_by_kind": {k: {f: (int(v) if f in ("count", "lost_steps")
                                                  else v) for f, v in row.items()}
                                          for k, row in self.by_kind().items()},
                "interruptions": [dataclasses.asdict(i) for i in self.interruptions],
                "incarnations": [dataclasses.asdict(i) for i in self.incarnations]}


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _str(x: object) -> str | None:
    return x if isinstance(x, str) and x else None


TRAINING_EVENTS = frozenset({"process_start", "first_step", "progress", "save_staged",
                             "restore_started"})
"""Events only a training process writes: a pid without any is another process (the uploader,
a drill injecting faults) whose failure reports belong to the training process alive then."""


def incarnations(records: Iterable[Mapping[str, Any]]) -> list[Incarnation]:
    """Rank 0's training processes, in start order, with what the accounting needs of each."""
    by_pid: dict[int, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("rank", 0) == 0 and _num(r.get("t")) is not None \
                and r.get("source") != "uploader":
            by_pid.setdefault(int(r.get("pid", 0)), []).append(r)
    trainers = {pid for pid, recs in by_pid.items()
                if any(r["event"] in TRAINING_EVENTS for r in recs)}
    failures_from_outside = sorted(float(r["t"]) for pid, recs in by_pid.items()
                                   if pid not in trainers for r in recs
                                   if r["event"] == "failure_detected")
    out = []
    for pid, recs in ((p, seg) for p in trainers for seg in _heal_segments(by_pid[p])):
        kinds = {r["event"]: r for r in reversed(recs)}  # first of each kind
        steps = [int(r["step"]) for r in recs if isinstance(r.get("step"), int)
                 and r["event"] in ("progress", "save_staged", "first_step")]
        first = kinds.get("first_step") or kinds.get("progress")
        restored = kinds.get("restore_done")
        start, end = float(recs[0]["t"]), float(recs[-1]["t"])
        stop = kinds.get("preempt_stop")
        failure = kinds.get("failure_detected")
        failure_t = None if failure is None else float(failure["t"])
        outside = [f for f in failures_from_outside if start <= f <= end]
        if outside and (failure_t is None or outside[0] < failure_t):
            failure_t = outside[0]
        began: Mapping[str, Any] = kinds.get("process_start") or {}
        raw = began.get("scheduler")
        sched: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
        out.append(Incarnation(
            pid=pid, start=start, first_step_t=None if first is None else float(first["t"]),
            end=end, first_step=min(steps, default=None), last_step=max(steps, default=None),
            resumed_from=None if restored is None else int(restored.get("step", -1)),
            failure_t=failure_t, stop_t=None if stop is None else float(stop["t"]),
            announced=any(saved_preemption(r) for r in recs),
            restart_count=_int(began.get("restart_count")), scheduler=_str(sched.get("name")),
            job_id=_str(sched.get("job_id")), requeue=_int(sched.get("restarts"))))
    return sorted(out, key=lambda i: i.start)


def _heal_segments(recs: list[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """One process's records in time order, cut before each ``heal_begin``: a heal keeps the
    process but ends an incarnation, as a restart does (its time is restart time)."""
    segments: list[list[Mapping[str, Any]]] = [[]]
    for r in sorted(recs, key=lambda r: float(r["t"])):
        if r["event"] == "heal_begin" and segments[-1]:
            segments.append([])
        segments[-1].append(r)
    return segments


def _save_parts(recs: list[Mapping[str, Any]], incs: list[Incarnation]) -> dict[str, float]:
    """Blocked, overlap and slowed seconds of every save, each save counted at its slowest
    rank (the ranks meet in every step's collectives, so the job waits for that one). A
    save is a step within an incarnation: records of any rank are placed by time in the
    rank-0 incarnation started last before them, so a step saved again after a resume
    counts twice, as it cost twice."""
    starts = [i.start for i in incs]
    worst: dict[str, dict[tuple[int, int], float]] = {
        "save_staged": {}, "overlap": {}, "save_cost": {}}
    for r in recs:
        into, step, s = worst.get(str(r.get("event"))), r.get("step"), _num(r.get("seconds"))
        if into is None or s is None or not isinstance(step, int) or isinstance(step, bool):
            continue
        key = (max(0, bisect.bisect_right(starts, float(r["t"])) - 1), step)
        into[key] = max(into.get(key, s), s)
    blocked = worst["save_staged"]
    return {"blocked": sum(blocked.values()), "overlap": sum(worst["overlap"].values()),
            "slowed": sum(max(0.0, c - blocked[k]) for k, c in worst["save_cost"].items()
                          if k in blocked)}


def account(records: Iterable[Mapping[str, Any]], *, node_mtbf_s: float | None = None,
            nodes: int = 1) -> Goodput:
    """The goodput of the run the records describe (see the module docstring)."""
    recs = [r for r in records if _num(r.get("t")) is not None
            and r.get("source") != "uploader"]
    incs = incarnations(recs)
    sec = dict.fromkeys(CATEGORIES, 0.0)
    if not incs:
        return Goodput(0.0, sec, (), 0, 0, None, None, None, None, None)
    t0 = min(float(r["t"]) for r in recs)
    t1 = max(float(r["t"]) for r in recs)
    staged = [r for r in recs if r.get("event") == "save_staged" and r.get("rank", 0) == 0]
    for part, seconds in _save_parts(recs, incs).items():
        sec[part] += seconds
    interruptions = _split_training(incs, sec)
    sec["productive"] -= sec["blocked"] + sec["slowed"] + sec["overlap"] + sec["lost_work"]
    wall = t1 - t0
    sec["unaccounted"] = wall - sum(v for k, v in sec.items() if k != "unaccounted")
    failures = sum(1 for i in interruptions if i.kind == "unannounced")
    saved_steps = sorted({int(r["step"]) for r in staged if isinstance(r.get("step"), int)})
    save_ts = sorted(float(r["t"]) for r in staged)
    tau = statistics.median([b - a for a, b in itertools.pairwise(save_ts)]) \
        if len(save_ts) > 1 else None
    per_save = [c for c, _ in costs.per_save(recs).values()]  # C + slower steps, if measured
    C = statistics.median(per_save) if per_save else None
    R = sum(i.restart_s for i in interruptions if i.kind == "unannounced") / failures \
        if failures else None
    M = (node_mtbf_s / nodes) if node_mtbf_s else (wall / failures if failures else None)
    predicted = None
    if tau and C and M:
        predicted = plan.waste(C, tau, M, R or 0.0).total
    return Goodput(wall_s=wall, seconds=sec, incarnations=tuple(incs), failures=failures,
                   saves=len(saved_steps), interval_s=tau, C_s=C, R_s=R, M_s=M,
                   predicted_waste=predicted, interruptions=interruptions)


def _split_training(incs: list[Incarnation], sec: dict[str, float]
                    ) -> tuple[Interruption, ...]:
    """Add each incarnation's start-up, restart, training and lost work to ``sec`` (the
    training still holds the saves' share); returns the interruptions between them."""
    dead_prev = None
    lost: list[tuple[int, float]] = []  # per incarnation but the last: steps, seconds
    restarts: list[float] = []  # per incarnation but the first
    for k, inc in enumerate(incs):
        begin = inc.first_step_t if inc.first_step_t is not None else inc.end
        last = k + 1 == len(incs)
        end = _training_end(inc, last)
        if dead_prev is None:
            sec["startup"] += max(0.0, begin - inc.start)
        else:
            restarts.append(max(0.0, begin - dead_prev))
            sec["restart"] += restarts[-1]
        dead_prev = end
        span = max(0.0, end - begin)
        sec["productive"] += span
        done = None if inc.first_step is None or inc.last_step is None else \
            inc.last_step - inc.first_step
        nxt = None if last else incs[k + 1]
        steps, seconds = 0, 0.0
        if done and nxt is not None and nxt.resumed_from is not None \
                and inc.last_step is not None:
            steps = max(0, inc.last_step - nxt.resumed_from)
            seconds = steps * span / done
            sec["lost_work"] += seconds
        if not last:
            lost.append((steps, seconds))
    return tuple(
        Interruption(kind="announced" if inc.announced else "unannounced",
                     at_t=_training_end(inc, False), lost_steps=steps, lost_work_s=seconds,
                     restart_s=restart)
        for inc, (steps, seconds), restart in zip(incs[:-1], lost, restarts, strict=True))


def _training_end(inc: Incarnation, last: bool) -> float:
    """When ``inc`` stopped training: its agreed stop (announced), else the failure's
    detection (what follows it is not training), else its last event."""
    if last:
        return inc.end
    if inc.announced and inc.stop_t is not None:
        return min(inc.end, inc.stop_t)
    return inc.end if inc.failure_t is None else min(inc.end, inc.failure_t)
