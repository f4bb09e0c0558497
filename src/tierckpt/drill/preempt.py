"""The preemption drill: a termination notice at a seeded step costs at most one step.

1. **reference** — the command uninterrupted: the losses to match.
2. **preempt** — the same command on fresh roots with tier 2. Once a seeded step is logged,
   the notice is sent: SIGTERM to the launcher (every torchrun agent, which forwards it to
   its workers, as a scheduler's preemption does), or with ``rank`` SIGUSR1 to that rank's
   worker alone (one pod, one node's metadata server: the others learn of it through the
   job's store). Every rank must stop at one agreed step, save it, carry it on as far as the
   grace allows, and exit with :data:`~tierckpt.preempt.config.EXIT_PREEMPTED`; torchrun
   itself then exits non-zero, which is this run's intended end.
3. **restart** — the command again on the same roots, to the end: it must resume from the
   saved step, its first step the next one, and every loss must equal the reference's.

Measured from the events against the wall-clock time the notice was sent: notice → every
rank received it, → every rank stopped, → durable on each tier reached (tier 0, tier 1,
tier 2), → every rank's ``preempt_saved``. Verdicts
(:data:`~tierckpt.drill.preempt_verdicts.PREEMPT_VERDICTS`): ``stop`` (every rank at one
step), ``saved`` (saved on every rank, exit status 75), ``lost_work`` (the saved step is at
or after the newest step logged when the notice was sent, nothing trained past it, the
restart resumes at the next), ``continuity`` (bit for bit on CPU) and ``verified`` (the
saved checkpoint verifies in full on every tier-1 root, and on tier 2 when reached).

:func:`run_preempt` returns the report document (:mod:`tierckpt.drill.preempt_report`) and
never raises for a failed verdict. ConfigError for bad configuration.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

from tierckpt.drill import preempt_verdicts as pv
from tierckpt.drill import verdicts as vd
from tierckpt.drill.chaos_verdicts import Verdict
from tierckpt.drill.drills import Progress, _fresh_out, _on_gpu
from tierckpt.drill.inject import _victim_pid, last_step
from tierckpt.drill.job import DrillJob, check_steps
from tierckpt.drill.launch import Job, JobSpec
from tierckpt.drill.preempt_report import build_preempt_report, write_preempt_report
from tierckpt.drill.runs import RunResult, run_job
from tierckpt.errors import CheckpointError
from tierckpt.format import layout
from tierckpt.ops.check import check_tier1, check_tier2
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime import events as ev
from tierckpt.tier2.storage import open_storage

__all__ = ["PREEMPT_STAGES", "NoticeRecord", "PreemptConfig", "run_preempt"]

PREEMPT_STAGES = ("reference", "preempt", "restart")
"""What :func:`run_preempt` reports progress for, in order (then ``report``)."""
_POLL_S = 0.01


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreemptConfig(DrillJob):
    """What to drill: the job (:class:`~tierckpt.drill.job.DrillJob`: ``command``, which
    must call ``CheckpointManager.should_stop`` each step, as ``examples/train.py`` does,
    with ``nproc`` ranks on each of ``nnodes`` simulated nodes; its ``seed`` picks the step
    of the notice; ``tier2``, which must be empty; ``rtol``), ``steps`` per run. ``rank``
    None sends SIGTERM to the launcher, a rank sends SIGUSR1 to that rank only;
    ``job_timeout_s`` bounds each run."""

    USAGE = "tierckpt drill --preempt -- python examples/train.py"

    steps: int = 20
    rank: int | None = None
    job_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_steps(self.steps, " (a notice, a stop and a resume need room)")
        pv.choose_notice(self.seed, steps=self.steps, world_size=self.world_size,
                         rank=self.rank)  # validates the rank and the steps now

    def spec(self, name: str, run: str, **kw: Any) -> JobSpec:
        """Job ``name`` on the roots of ``run`` (the restart runs on the preempted roots),
        logging its losses to ``runs/<run>/losses-<name>.jsonl``."""
        return JobSpec(name=name, command=self.command, nproc=self.nproc,
                       roots=self.roots(run), steps=self.steps,
                       losses=self.out / "runs" / run / f"losses-{name}.jsonl", **kw)


@dataclasses.dataclass(frozen=True)
class NoticeRecord:
    """The notice as sent: after ``seen`` (the newest step logged then; the plan said
    ``planned_step``), at wall-clock ``t``, ``signal`` to ``target`` (``launcher`` or
    ``rank <r> pid <p>``)."""

    planned_step: int
    seen: int
    t: float
    signal: str
    target: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _noop(stage: str, state: str, detail: str) -> None:
    pass


def run_preempt(cfg: PreemptConfig, progress: Progress = _noop) -> dict[str, Any]:
    """Run the preemption drill (in a fresh ``<out>/runs``), write ``preempt-report.json``
    and ``preempt-report.md`` into ``out`` (``doc["files"]``) and return the report."""
    doc = _run(cfg, progress)
    progress("report", "running", "")
    write_preempt_report(doc, cfg.out)
    progress("report", "passed" if doc["ok"] else "failed", doc["files"]["md"])
    return doc


def _run(cfg: PreemptConfig, progress: Progress) -> dict[str, Any]:
    tier2 = _fresh_out(cfg)
    t0 = time.time()
    plan = pv.choose_notice(cfg.seed, steps=cfg.steps, world_size=cfg.world_size,
                            rank=cfg.rank)
    runs: list[RunResult] = []
    verdicts: list[Verdict] = []
    progress("reference", "running", "")
    ref = run_job(cfg.spec("reference", "reference"), timeout_s=cfg.job_timeout_s)
    runs.append(ref)
    logged = sorted(vd.losses_by_step(ref.rows))
    if ref.rc != 0 or logged != list(range(cfg.steps)):
        error = (f"the reference run failed (exit {ref.rc}, logged {len(logged)} of "
                 f"{cfg.steps} steps): {ref.log_tail[-1500:]}")
        progress("reference", "failed", error[:200])
        for stage in PREEMPT_STAGES[1:]:
            progress(stage, "skipped", "the reference run failed")
        return build_preempt_report(cfg=cfg, plan=plan, notice=None, timings=None,
                                    verdicts=[], runs=runs, error=error, t0=t0)
    progress("reference", "passed", f"{len(logged)} steps")
    progress("preempt", "running", f"notice after step {plan.step}")
    sent: list[NoticeRecord] = []
    pre = run_job(cfg.spec("preempt", "preempt", tier2=tier2), timeout_s=cfg.job_timeout_s,
                  act=lambda job: sent.append(send_notice(plan, job,
                                                          timeout_s=cfg.job_timeout_s)))
    runs.append(pre)
    notice = sent[0] if sent else None
    if notice is None:
        error = f"the notice was not sent: {pre.notes.get('kill_error') or pre.log_tail[-1500:]}"
        progress("preempt", "failed", error[:200])
        progress("restart", "skipped", "no notice was sent")
        return build_preempt_report(cfg=cfg, plan=plan, notice=None, timings=None,
                                    verdicts=[], runs=runs, error=error, t0=t0)
    verdicts.append(pv.stop_verdict(pre.events, world_size=cfg.world_size))
    step = verdicts[0].facts["step"]
    verdicts.append(pv.saved_verdict(pre.events, step=step, world_size=cfg.world_size,
                                     exit_code=EXIT_PREEMPTED))
    timings = pv.notice_timings(pre.events, t_sent=notice.t, step=step)
    # before the restart: its retention may delete the step once newer ones are committed
    verified = _verified(cfg, step, "tier2" in timings["reached"])
    progress("preempt", "passed" if all(v.ok for v in verdicts) else "failed",
             f"{notice.signal} to the {notice.target} after step {notice.seen}; stopped "
             f"after step {step}")
    progress("restart", "running", "")
    again = run_job(cfg.spec("restart", "preempt", tier2=tier2), timeout_s=cfg.job_timeout_s)
    runs.append(again)
    verdicts += [*_after_restart(cfg, ref, pre, again, notice, step), verified]
    bad = [v.name for v in verdicts[2:] if not v.ok]
    progress("restart", "failed" if bad else "passed", ", ".join(bad) or
             f"resumed at step {None if step is None else step + 1}")
    return build_preempt_report(cfg=cfg, plan=plan, notice=notice.as_dict(), timings=timings,
                                verdicts=verdicts, runs=runs, error=None, t0=t0,
                                launcher_rc=pre.rc)


def send_notice(plan: pv.NoticePlan, job: Job, *, timeout_s: float) -> NoticeRecord:
    """Once ``plan.step`` is in the job's losses file (and, for one rank, that rank's pid is
    known from its ``process_start`` event), send the plan's signal: to every agent (the
    launcher forwards it to its workers) or to the rank's worker. CheckpointError when the
    job ends, or the step does not come, within ``timeout_s``."""
    spec = job.spec
    logs = [r / layout.EVENTS for r in spec.roots]
    deadline = time.monotonic() + timeout_s
    victim: tuple[int, Path] | None = None
    while True:
        if plan.rank is not None and victim is None:
            victim = _victim_pid(logs, plan.rank)
        if last_step(spec.losses) >= plan.step and (plan.rank is None or victim is not None):
            break
        if not job.running():
            raise CheckpointError(f"preemption drill: the job ended before step {plan.step}")
        if time.monotonic() > deadline:
            raise CheckpointError(f"preemption drill: step {plan.step} not logged within "
                                  f"{timeout_s:.0f} s")
        time.sleep(_POLL_S)
    sig = signal.Signals[plan.signal]
    seen = last_step(spec.losses)
    t = time.time()
    if victim is None:
        for p in job.procs:
            p.send_signal(sig)
        target = "launcher" if len(job.procs) == 1 else f"{len(job.procs)} launchers"
    else:
        os.kill(victim[0], sig)
        target = f"rank {plan.rank} pid {victim[0]}"
    return NoticeRecord(planned_step=plan.step, seen=seen, t=t, signal=plan.signal,
                        target=target)


def _after_restart(cfg: PreemptConfig, ref: RunResult, pre: RunResult, again: RunResult,
                   notice: NoticeRecord, step: int | None) -> list[Verdict]:
    """``lost_work`` and ``continuity`` once the restart has run."""
    later = [e for e in again.events if float(e.get("t", 0.0)) >= again.t_start]
    chosen = {e.get("step") for e in later if e.get("event") == ev.CHECKPOINT_CHOSEN}
    resumed_from = next(iter(chosen)) if len(chosen) == 1 else None
    first = min((int(r["step"]) for r in again.rows), default=None)
    logged_max = max((int(r["step"]) for r in pre.rows), default=-1)
    out = [pv.lost_work_verdict(stop_step=step, seen=notice.seen, logged_max=logged_max,
                                resumed_from=resumed_from, first_resumed=first,
                                arrived=pv.arrival_step(pre.events))]
    rtol = cfg.rtol if cfg.rtol is not None else (vd.GPU_RTOL if _on_gpu(again) else 0.0)
    rows = [*({**r, "attempt": 0} for r in pre.rows), *({**r, "attempt": 1} for r in again.rows)]
    cont = vd.continuity(ref.rows, rows, rtol=rtol, resumed_from=resumed_from)
    ok = cont.ok and again.rc == 0
    detail = (f"{cont.compared} losses {'bit-identical' if rtol == 0 else 'within rtol'}"
              if ok else f"restart exit {again.rc}; {len(cont.mismatches)} mismatches, "
              f"missing {cont.missing[:5]}")
    out.append(Verdict("continuity", ok, detail, {**cont.as_dict(), "restart_rc": again.rc,
                                                  "log_tail": again.log_tail[-1500:]}))
    return out


def _verified(cfg: PreemptConfig, step: int | None, tier2: bool) -> Verdict:
    """The saved step verifies in full on every tier-1 root, and on tier 2 when reached
    (checked before the restart, whose retention may delete it)."""
    if step is None:
        return Verdict("verified", False, "no agreed step to verify", {})
    checks = [check_tier1(root, step) for root in cfg.roots("preempt")]
    if tier2:
        assert cfg.tier2 is not None
        with open_storage(cfg.tier2) as storage:
            checks.append(check_tier2(storage, step, scratch=cfg.out / "runs"))
    facts = {"checks": [c.to_json() for c in checks]}
    bad = [c for c in checks if not c.ok]
    if bad:
        return Verdict("verified", False, "; ".join(f"{c.location}: {c.error}"
                                                   for c in bad[:3]), facts)
    where = "tier 1" + (" and tier 2" if tier2 else "")
    return Verdict("verified", True, f"step {step} verifies in full on {where}", facts)
