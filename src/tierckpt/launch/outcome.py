"""The verdict after a training step ends under a launcher: run it again or not, and the
exit status that says which. Pure but for :func:`read_slurm_job`.

Only an *announced* interruption whose emergency save was committed is run again:

- under Slurm, announced means the job was preempted (``scontrol show job`` has a
  ``PreemptTime``: Slurm signals the steps, not the batch shell) or the batch shell got the
  ``--signal=B:USR1`` lead before the time limit. A batch shell that got SIGTERM while the
  job was neither preempted nor at its time limit was cancelled by its user (``scancel``):
  never run again;
- elsewhere (Kubernetes), the launcher's SIGTERM is the notice;
- the save is a ``preempt_saved`` event in the tier-1 root since the step started (torchrun
  exits 1 after a forwarded signal, whatever its workers did, so its status cannot tell).

A step that ended without a notice keeps its own status (0: all steps done). The exit
status of a verdict to run again is :data:`EXIT_PREEMPTED` (75), which a Kubernetes
``podFailurePolicy`` keys on; :data:`EXIT_CONFIG` (2) is a launcher configuration error,
never retried.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime import events as ev

EXIT_CONFIG = 2
"""The launcher's own configuration is wrong (a tier path unset, a missing tool): fix it,
do not retry."""

NOTICES = ("usr1", "term")
"""What a launcher's shell may have received: Slurm's ``--signal=B:USR1`` lead, SIGTERM."""


@dataclasses.dataclass(frozen=True)
class SlurmFacts:
    """What ``scontrol show job`` says of the running job."""

    job_id: str
    state: str
    reason: str
    preempted: bool
    restarts: int
    requeue: bool


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``code``: the exit status to end with; ``again``: the scheduler should run the job
    again (Slurm: ``scontrol requeue``); ``why``: one line for the job's log."""

    code: int
    again: bool
    why: str


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol -o show job`` (or partition) output as ``{Key: value}``."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def read_slurm_job(job_id: str, *, timeout_s: float = 15.0) -> SlurmFacts:
    """Ask ``scontrol`` about ``job_id``. ConfigError naming what to fix when it cannot."""
    try:
        p = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                           text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"cannot ask scontrol about job {job_id}: {e}; run this inside the "
                          "Slurm job, with the Slurm client tools on PATH") from None
    if p.returncode != 0:
        raise ConfigError(f"scontrol show job {job_id} failed: {p.stderr.strip()}")
    f = parse_scontrol(p.stdout)
    return SlurmFacts(job_id=job_id, state=f.get("JobState", ""), reason=f.get("Reason", ""),
                    preempted=f.get("PreemptTime", "None") not in ("None", "Unknown", ""),
                    restarts=int(f.get("Restarts", "0") or 0),
                    requeue=f.get("Requeue", "0") == "1")


def emergency_save(records: Iterable[Mapping[str, Any]], since_unix: float
                   ) -> Mapping[str, Any] | None:
    """The newest ``preempt_saved`` at or after ``since_unix`` that reached a tier."""
    found = None
    for r in records:
        t = r.get("t")
        if (r.get("event") == ev.PREEMPT_SAVED and r.get("reached")
                and isinstance(t, int | float) and t >= since_unix):
            found = r
    return found


def finished(records: Iterable[Mapping[str, Any]], since_unix: float) -> bool:
    """Whether rank 0's manager closed cleanly at or after ``since_unix`` without stopping
    on a notice: the job ran to its end (a notice that came after that found nothing to
    save, and a launcher that dies of it has still finished the work)."""
    done = False
    for r in records:
        t = r.get("t")
        if (r.get("event") == ev.MANAGER_CLOSED and r.get("rank", 0) == 0
                and isinstance(t, int | float) and t >= since_unix):
            done = bool(r.get("clean")) and not r.get("stopped")
    return done


def decide(*, rc: int, notices: Iterable[str], saved: Mapping[str, Any] | None,
           slurm: SlurmFacts | None = None, max_requeues: int | None = None,
           done: bool = False) -> Verdict:
    """Decide after a step that exited ``rc``. ``notices``: what the launcher's shell got
    (:data:`NOTICES`); ``saved``: :func:`emergency_save`'s answer; ``slurm``: the job,
    under Slurm; ``max_requeues``: run again at most this many times (``slurm.restarts``
    counts them); ``done``: :func:`finished`'s answer."""
    got = set(notices)
    unknown = got - set(NOTICES)
    if unknown:
        raise ConfigError(f"unknown notice {sorted(unknown)}; a launcher reports "
                          f"{', '.join(NOTICES)}")
    if slurm is not None:
        if "term" in got and not slurm.preempted and slurm.reason != "TimeLimit":
            return Verdict(rc, False, "cancelled by its user (SIGTERM to the batch shell, "
                           "not preempted, not at the time limit): not run again")
        announced = slurm.preempted or "usr1" in got
        what = "preempted" if slurm.preempted else "time limit ahead (--signal)"
    else:
        announced = bool(got)
        what = "terminated (SIGTERM)"
    if not announced:
        how = "finished" if rc == 0 else f"failed with status {rc}"
        return Verdict(rc, False, f"no notice: the job {how}; not run again")
    if saved is None and done:
        return Verdict(0, False, f"{what}, but the job had run to its end (its managers "
                       "closed cleanly before the notice took effect): not run again")
    if saved is None:
        return Verdict(rc or 1, False, f"{what}, but no emergency save was committed since "
                       "the step started: not run again (its newest periodic checkpoint "
                       "stands; resubmit to resume from it)")
    step, tiers = saved.get("step"), ", ".join(saved.get("reached") or ())
    if slurm is not None and max_requeues is not None and slurm.restarts >= max_requeues:
        return Verdict(EXIT_PREEMPTED, False, f"{what}; emergency save of step {step} on "
                       f"{tiers}; requeue limit {max_requeues} reached: not run again")
    return Verdict(EXIT_PREEMPTED, True, f"{what}; emergency save of step {step} on {tiers}: "
                   "run again")
