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
  exits 1 after a forwarded signal, whatever its workers did, so its status cannot tell);
- under Slurm the job usually asked for its requeue itself (rank 0, after its emergency
  save: :mod:`tierckpt.preempt.requeue`, a ``slurm_requeue`` event): the verdict is then 75
  without ``again``, so a launcher never requeues twice.

Which Slurm notices are announced and which are a ``scancel`` is
:func:`tierckpt.runtime.scheduler.slurm_interruption`, the one rule the job's own requeue
follows too.

A step that ended without a notice keeps its own status (0: all steps done). The exit
status of a verdict to run again is :data:`EXIT_PREEMPTED` (75), which a Kubernetes
``podFailurePolicy`` keys on; :data:`EXIT_CONFIG` (2) is a launcher configuration error,
never retried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime import events as ev
from tierckpt.runtime.scheduler import (
    NOTICES,
    SlurmFacts,
    notice_words,
    parse_scontrol,
    read_slurm_job,
    slurm_interruption,
)

__all__ = ["EXIT_CONFIG", "NOTICES", "SlurmFacts", "Verdict", "decide", "emergency_save",
           "finished", "parse_scontrol", "read_slurm_job", "requeued_by_job"]

EXIT_CONFIG = 2
"""The launcher's own configuration is wrong (a tier path unset, a missing tool): fix it,
do not retry."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``code``: the exit status to end with; ``again``: the launcher should ask the
    scheduler to run the job again (Slurm: ``scontrol requeue``); ``requeued``: the job
    already asked for it itself (:mod:`tierckpt.preempt.requeue`): do not ask twice;
    ``why``: one line for the job's log."""

    code: int
    again: bool
    why: str
    requeued: bool = False


def _newest(records: Iterable[Mapping[str, Any]], since_unix: float, event: str,
            flag: str) -> Mapping[str, Any] | None:
    """The newest ``event`` record at or after ``since_unix`` whose ``flag`` is truthy."""
    found = None
    for r in records:
        t = r.get("t")
        if (r.get("event") == event and r.get(flag)
                and isinstance(t, int | float) and t >= since_unix):
            found = r
    return found


def emergency_save(records: Iterable[Mapping[str, Any]], since_unix: float
                   ) -> Mapping[str, Any] | None:
    """The newest ``preempt_saved`` at or after ``since_unix`` that reached a tier."""
    return _newest(records, since_unix, ev.PREEMPT_SAVED, "reached")


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


def requeued_by_job(records: Iterable[Mapping[str, Any]], since_unix: float
                    ) -> Mapping[str, Any] | None:
    """The newest ``slurm_requeue`` at or after ``since_unix`` whose ``scontrol requeue``
    succeeded: the job requeued itself after its emergency save."""
    return _newest(records, since_unix, ev.SLURM_REQUEUE, "requeued")


def decide(*, rc: int, notices: Iterable[str], saved: Mapping[str, Any] | None,
           slurm: SlurmFacts | None = None, max_requeues: int | None = None,
           done: bool = False, requeued: Mapping[str, Any] | None = None) -> Verdict:
    """Decide after a step that exited ``rc``. ``notices``: what the launcher's shell got
    (:data:`NOTICES`); ``saved``: :func:`emergency_save`'s answer; ``slurm``: the job,
    under Slurm; ``max_requeues``: run again at most this many times (``slurm.restarts``
    counts them); ``done``: :func:`finished`'s answer; ``requeued``:
    :func:`requeued_by_job`'s answer (then the verdict is 75 without ``again``: one
    requeue, never two). ConfigError for an unknown notice word."""
    got = notice_words(notices)
    if slurm is not None:
        if requeued is not None:  # its own words: Slurm's kill after it adds a SIGTERM here
            return Verdict(EXIT_PREEMPTED, False, f"the job requeued itself: "
                           f"{requeued.get('why')}; not requeued again", requeued=True)
        kind = slurm_interruption(got, slurm)
        if kind.cancelled:
            return Verdict(rc, False, f"{kind.what}: not run again")
        announced, what = kind.announced, kind.what
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
