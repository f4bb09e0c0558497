"""Under Slurm, a job that stopped on an announced notice and committed its emergency save
asks Slurm to run it again itself: ``scontrol requeue $SLURM_JOB_ID``, from rank 0, once per
job, before the process exits 75. Torch-free.

Why the job asks, and not only a launcher's script: a job that saves and exits within the
partition's ``GraceTime`` ends COMPLETED — Slurm requeues a preempted job only if it still
runs when the grace is over — and one at its time limit ends TIMEOUT. So a user's own
sbatch script with ``#SBATCH --requeue`` and the loop contract (``should_save`` /
``should_stop``) is requeued with no extra lines.

The rule (:func:`decide`, pure), every condition required:

1. the job runs under Slurm (``SLURM_JOB_ID``) and ``Preemption.slurm_requeue`` is on;
2. the emergency save reached a tier;
3. Slurm may requeue it: ``scontrol show job`` says ``Requeue=1`` (``--requeue``, or the
   cluster's ``JobRequeue=1``);
4. the interruption was announced
   (:func:`tierckpt.runtime.scheduler.slurm_interruption`, the rule ``tierckpt launch
   outcome`` follows too): a preemption (``PreemptTime`` set) or the ``--signal`` lead's
   USR1. A ``scancel``'s SIGTERM (neither preempted nor at the time limit) never requeues;
5. fewer requeues so far than ``$TIERCKPT_MAX_REQUEUES`` (unset: no limit of ours).

:func:`after_emergency_save` asks ``scontrol`` (each call bounded by ``timeout_s``) and
records every outcome, requeued or not and why, as a ``slurm_requeue`` event and one log
line. It never raises: the emergency save stands either way. ``tierckpt launch outcome``
reads the event, so a generated script that also requeues never asks twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence

from tierckpt.errors import ConfigError
from tierckpt.preempt.notice import Notice
from tierckpt.runtime import events
from tierckpt.runtime.scheduler import (
    SlurmFacts,
    max_requeues,
    read_slurm_job,
    slurm_interruption,
)

_log = logging.getLogger("tierckpt")

SCONTROL_TIMEOUT_S = 15.0
"""The most one ``scontrol`` call may take (slurmctld answers in milliseconds when well)."""

_KINDS = {"signal:SIGUSR1": "usr1", "signal:SIGTERM": "term"}

Runner = Callable[[Sequence[str], float], tuple[int, str]]
"""Runs a command with a timeout: (exit status, its output). The default runs it; tests
may pass their own."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """``requeue``: ask Slurm to run the job again; ``why``: one line for the log."""

    requeue: bool
    why: str


def notice_kind(notice: Notice | None) -> str | None:
    """The Slurm notice word (``usr1``, ``term``) of a notice this rank acted on, also when
    it came from another rank (source ``rank:<r>``, the original source in ``detail``);
    None for any other source (a trigger file, a cloud poller)."""
    if notice is None:
        return None
    source = notice.detail if notice.source.startswith("rank:") else notice.source
    return _KINDS.get(source)


def decide(facts: SlurmFacts, *, kind: str | None, step: int, reached: Sequence[str],
           limit: int | None) -> Decision:
    """Whether to requeue after the emergency save of ``step`` reached ``reached`` (see the
    module docstring). ``kind``: :func:`notice_kind`; ``limit``: the most requeues (None:
    no limit). Pure."""
    if not reached:
        return Decision(False, f"the emergency save of step {step} reached no tier")
    kind_ = slurm_interruption([kind] if kind else [], facts)
    saved = f"{kind_.what}; emergency save of step {step} on {', '.join(reached)}"
    if kind_.cancelled:
        return Decision(False, f"{kind_.what}: not requeued")
    if not kind_.announced:
        return Decision(False, "the notice did not come from Slurm (not preempted, no "
                        "--signal USR1): not requeued")
    if not facts.requeue:
        return Decision(False, f"{saved}; job {facts.job_id} is not requeueable (Requeue=0): "
                        "submit it with #SBATCH --requeue to have it run again")
    if limit is not None and facts.restarts >= limit:
        return Decision(False, f"{saved}; requeue limit {limit} reached "
                        f"(TIERCKPT_MAX_REQUEUES): not requeued")
    return Decision(True, saved)


def after_emergency_save(*, notice: Notice | None, step: int, reached: Sequence[str],
                         log: events.EventLog, env: Mapping[str, str] | None = None,
                         timeout_s: float = SCONTROL_TIMEOUT_S, run: Runner | None = None
                         ) -> Decision | None:
    """Rank 0, once per job, after every rank's emergency save is committed: requeue the
    job when :func:`decide` says so. None when not under Slurm (nothing logged); else the
    decision, with ``requeue`` True only when ``scontrol requeue`` succeeded. Never
    raises; each ``scontrol`` call is bounded by ``timeout_s``."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    runner = run or _run
    try:
        facts = read_slurm_job(job, timeout_s=timeout_s)
        d = decide(facts, kind=notice_kind(notice), step=step, reached=reached,
                   limit=max_requeues(env))
    except ConfigError as e:
        d = Decision(False, f"cannot decide on a requeue: {e}")
    if d.requeue:
        code, out = runner(["scontrol", "requeue", job], timeout_s)
        if code != 0:
            d = Decision(False, f"{d.why}; scontrol requeue {job} failed ({out.strip()})")
    log.emit(events.SLURM_REQUEUE, step=step, job_id=job, requeued=d.requeue, why=d.why)
    if d.requeue:
        _log.warning("Slurm job %s: %s: requeued (scontrol requeue)", job, d.why)
    else:
        _log.warning("Slurm job %s: %s", job, d.why)
    return d


def _run(argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, str(e)
    return p.returncode, p.stdout + p.stderr
