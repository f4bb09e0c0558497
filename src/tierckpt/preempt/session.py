"""One manager's preemption machinery, from start-up to exit: the notice sources, the stop
watcher, the emergency save's carry to the most durable tier the grace allows, and the
exit status. :class:`~tierckpt.CheckpointManager` calls it at each check
(``should_save``/``should_stop``) and at ``close()``.

The carry (after the save at the agreed step is committed on the fastest tier):

- kept in RAM only (tier 0) → copied to tier 1, unless this run's measured tier-1 write
  time says it cannot end by ``deadline - margin`` (then it is left in RAM, and named);
- with tier 2 → the step is asked for by name (whatever ``upload_every`` says), and
  ``close()`` gives the uploader what is left of the grace, minus the margin, unless the
  measured upload time says it cannot make it. An upload cut off writes no marker, so a
  partial copy is never trusted.

``preempt_saved`` names what was reached and what was abandoned, and why. Under Slurm,
rank 0 then waits (bounded by the notice's deadline) for every rank's ``finish`` and asks
Slurm to requeue the job (:mod:`tierckpt.preempt.requeue`).

The grace a notice without a deadline of its own gets (a signal, a trigger file without a
number) is resolved once, at start-up (:func:`resolve_grace`): ``Preemption.grace_s`` when
set, else what the launcher or scheduler says (:func:`tierckpt.runtime.scheduler.notice_grace`:
``$TIERCKPT_GRACE_S``, or Slurm's ``--signal`` lead and ``GraceTime``, per signal), else
:data:`~tierckpt.preempt.config.DEFAULT_GRACE_S`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tierckpt.errors import CheckpointError
from tierckpt.policy import notice as notice_plan
from tierckpt.preempt import requeue
from tierckpt.preempt.config import DEFAULT_GRACE_S, Poller, Preemption
from tierckpt.preempt.notice import NoticeBox
from tierckpt.preempt.signals import SignalNotices
from tierckpt.preempt.watch import StopWatch, Store
from tierckpt.runtime import events, rates
from tierckpt.runtime.distributed import process_started_at
from tierckpt.runtime.scheduler import Grace, notice_grace

_log = logging.getLogger("tierckpt")

REQUEUE_WAIT_MIN_S, REQUEUE_WAIT_MAX_S = 5.0, 120.0
"""Bounds of rank 0's wait for the other ranks' close before it asks Slurm to requeue."""


@dataclasses.dataclass
class Carry:
    """What the emergency save reached (fastest first) and what it did not, with why."""

    step: int
    reached: list[str] = dataclasses.field(default_factory=list)
    abandoned: dict[str, str] = dataclasses.field(default_factory=dict)
    drain_s: float | None = None
    """Seconds ``close()`` gives the uploader (None: no tier 2, or not attempted)."""


class PreemptSession:
    """Built at the manager's start (collective only in that every rank builds one).
    ``store``: a private connection to the job's store (None: a single process).
    ``grace``: :func:`resolve_grace`'s answer, resolved once for the job (rank 0 asks the
    scheduler and broadcasts it, so ranks agree and slurmctld gets one request); None:
    resolved here."""

    def __init__(self, config: Preemption, *, store: Store | None, rank: int,
                 world_size: int, run_id: str, log: events.EventLog,
                 events_path: Path, grace: Grace | None = None) -> None:
        self.config, self.log, self.events_path = config, log, events_path
        self.box = NoticeBox()
        self.grace = grace if grace is not None else resolve_grace(config)
        self.signals = _signal_notices(self.box, config.signals, self.grace)  # armed later
        self.watch = StopWatch(self.box, store=store, rank=rank, world_size=world_size,
                               key=f"tierckpt/preempt/{run_id}", poll_s=config.watch_s,
                               pollers=(*config.pollers, *_trigger(config, self.grace)),
                               log=log, margin_s=config.margin_s).start()
        self.stopped_at: int | None = None
        self.carry: Carry | None = None

    # -- the loop's checks ----------------------------------------------------------------
    def target(self, step: int) -> int | None:
        """The agreed stop step once a notice is known (waits for the agreement), else
        None. Records ``step`` as this rank's progress first."""
        w = self.watch
        if step > w.progress:
            w.progress = step
        if not w.noticed:
            return None
        target = w.wait_target(step)
        if target is None:
            raise CheckpointError(f"preemption: {w.error}; stopping without an emergency "
                                  "save (the newest committed checkpoint is the resume point)")
        return target

    def should_save(self, step: int) -> bool:
        """True at the agreed step (the loop's ``should_save`` ORs it in)."""
        return self.stopped_at is None and self.target(step) == step

    def at_stop(self, step: int) -> bool:
        """``should_stop``'s decision: arms the signals (the opt-in); True at the agreed
        step (or after it was taken)."""
        for s in self.signals:
            s.arm()  # installed now: until this, a signal keeps its default action
        if self.stopped_at is not None:
            return True
        target = self.target(step)
        if target is None or step < target:
            return False
        if step > target:  # cannot happen in lockstep: say so rather than save late
            _log.error("preemption: the agreed step was %d but this rank is at %d", target,
                       step)
        n = self.watch.notice
        self.log.emit(events.PREEMPT_STOP, step=step, source=n.source if n else None,
                      notice_s=time.time() - n.received_unix if n else None,
                      deadline_unix=n.deadline_unix if n else None)
        self.stopped_at = step
        return True

    # -- the carry ------------------------------------------------------------------------
    def carry_save(self, step: int, *, nbytes: int, tier: str, tier0: bool, tier2: bool,
                   flush: Callable[[], None], request_upload: Callable[[int], None]) -> Carry:
        """After the emergency save of ``step`` committed on ``tier`` (``tier0``: kept in
        RAM only; ``tier1``): copy it on as far as the grace allows (see the module
        docstring). ``flush`` copies the RAM save to tier 1 (collective);
        ``request_upload`` asks this root's uploader for the step."""
        c = Carry(step=step, reached=["tier0"] if tier == "tier0" else [])
        if tier0 and tier != "tier0":
            c.reached.append("tier0")  # a tier-1 save with tier 0 on is in RAM as well
        rates, logged_bytes = measured_rates(self.events_path)
        nbytes = int(logged_bytes) if logged_bytes else nbytes  # the rates' own basis
        if tier == "tier0":
            why: str | None = self._too_slow("tier1", nbytes, rates)
            if why is None:
                try:
                    flush()
                    c.reached.append("tier1")
                except Exception as e:
                    c.abandoned["tier1"] = f"the copy failed: {e}"
            else:
                c.abandoned["tier1"] = why
        else:
            c.reached.append("tier1")
        if tier2:
            left = self.remaining_s() - self.config.margin_s
            if "tier1" not in c.reached:
                why = "tier 1 was not reached (tier 2 copies from it)"
            elif left <= 0:
                why = "no grace left"
            else:
                why = self._too_slow("tier2", nbytes, rates)
            if why is None:
                request_upload(step)
                c.drain_s = left
            else:
                c.abandoned["tier2"] = why
        self.carry = c
        return c

    def _too_slow(self, tier: str, nbytes: int, rates: dict[str, float | None]
                  ) -> str | None:
        """Why a copy of ``nbytes`` to ``tier`` cannot end by ``deadline - margin`` at this
        run's measured rate; None when it can, or when the rate is not known yet (the copy
        is bounded by the deadline either way: an attempt costs nothing trusted)."""
        link = notice_plan.plan(nbytes, grace_s=self.remaining_s(), tiers=(tier,),
                                rates_bps=rates, margin_s=self.config.margin_s).links[0]
        return None if link.reached or math.isinf(link.end_s) else link.why

    def finish(self, *, tier2_left: list[int] | None) -> None:
        """At close, after the uploader's bounded drain (``tier2_left``: steps it left on
        tier 1; None: this rank has no uploader): log ``preempt_saved``."""
        c = self.carry
        if c is None:
            return
        if c.drain_s is not None and tier2_left is not None:
            if c.step in tier2_left:
                c.abandoned["tier2"] = (f"the upload did not finish in the {c.drain_s:.1f} s "
                                        "left (no marker: the partial copy is not trusted)")
            else:
                c.reached.append("tier2")
        n = self.watch.notice
        self.log.emit(events.PREEMPT_SAVED, step=c.step, reached=c.reached,
                      abandoned=c.abandoned,
                      seconds=time.time() - n.received_unix if n else None,
                      remaining_s=self.remaining_s())
        _log.warning("preemption: step %d saved to %s%s", c.step, ", ".join(c.reached),
                     "".join(f"; not {t}: {why}" for t, why in c.abandoned.items()))
        if self.config.slurm_requeue and c.reached and os.environ.get("SLURM_JOB_ID"):
            self._requeue(c)
        if self.config.exit_code is not None:
            self.log.emit(events.PREEMPT_EXIT, step=c.step, code=self.config.exit_code)

    def _requeue(self, c: Carry) -> None:
        """Every rank counts itself done; rank 0 waits for all (at most until the notice's
        deadline, at least :data:`REQUEUE_WAIT_MIN_S`: a requeue kills every process of
        the job, so none may still be copying) and asks Slurm to requeue. Never raises."""
        w = self.watch
        try:
            w.arrive("finished")
            if w.rank != 0:
                return
            wait_s = min(max(self.remaining_s(), REQUEUE_WAIT_MIN_S), REQUEUE_WAIT_MAX_S)
            done = w.wait_arrived("finished", wait_s)
            if done < w.world_size:
                _log.warning("preemption: %d of %d ranks finished their close in %.0f s; "
                             "asking for the requeue anyway (the save is committed)", done,
                             w.world_size, wait_s)
            requeue.after_emergency_save(notice=w.notice or self.box.first, step=c.step,
                                         reached=c.reached, log=self.log)
        except Exception as e:  # the save stands: a failed requeue is logged, never raised
            _log.warning("preemption: no Slurm requeue (%s: %s)", type(e).__name__, e)

    def remaining_s(self) -> float:
        n = self.watch.notice or self.box.first
        return n.remaining_s() if n is not None else float("inf")

    def close(self) -> None:
        self.watch.close()
        for s in self.signals:
            s.uninstall()


def resolve_grace(config: Preemption, env: Mapping[str, str] | None = None) -> Grace:
    """The grace of each notice source without a deadline of its own: ``config.grace_s``
    for all when set; else the launcher's or scheduler's
    (:func:`~tierckpt.runtime.scheduler.notice_grace` over ``env``, default
    ``os.environ``: at most about a second under Slurm), each signal it does not name
    getting :data:`~tierckpt.preempt.config.DEFAULT_GRACE_S`. ConfigError for a malformed
    ``$TIERCKPT_GRACE_S``."""
    if config.grace_s is not None:
        return Grace(seconds=config.grace_s, source=f"Preemption(grace_s={config.grace_s:g})")
    found = notice_grace(os.environ if env is None else env)
    if found is None:
        return Grace(seconds=DEFAULT_GRACE_S, source=f"the default {DEFAULT_GRACE_S:g} s")
    _log.info("preemption: grace from %s", found.source)
    if found.seconds is None:
        return dataclasses.replace(found, seconds=DEFAULT_GRACE_S,
                                   source=f"{found.source}; else {DEFAULT_GRACE_S:g} s")
    return found


def _signal_notices(box: NoticeBox, signals: tuple[int, ...], grace: Grace
                    ) -> list[SignalNotices]:
    """One handler set per distinct grace (Slurm's SIGUSR1 and SIGTERM may differ)."""
    by_grace: dict[float, list[int]] = {}
    for s in signals:
        by_grace.setdefault(grace.for_signal(s) or DEFAULT_GRACE_S, []).append(s)
    return [SignalNotices(box, tuple(sigs), grace_s=g) for g, sigs in by_grace.items()]


def _trigger(config: Preemption, grace: Grace) -> tuple[Poller, ...]:
    path = config.trigger_path()
    if path is None:
        return ()
    from tierckpt.preempt.pollers import FileTrigger
    # a file older than this process is a notice an earlier incarnation already acted on
    return (FileTrigger(path, grace_s=grace.seconds or DEFAULT_GRACE_S,
                        since_unix=process_started_at()),)


def measured_rates(events_path: Path) -> tuple[dict[str, float | None], float | None]:
    """This root's measured bytes/s into tier 1 and tier 2 (the slowest of the recent saves
    and uploads: :func:`tierckpt.runtime.rates.measure_chain`; None where nothing was
    measured), and the bytes a save writes on the ranks of this log (None: unknown)."""
    try:
        chain = rates.measure_chain(events.iter_events(events_path))
    except OSError:
        return {"tier1": None, "tier2": None}, None
    measured = {t: (chain.rates[t].value if t in chain.rates else None)
                for t in ("tier1", "tier2")}
    return measured, chain.nbytes.value if chain.nbytes is not None else None
