"""``CheckpointManager``: the facade that composes staging, the async saver, commit,
retention, resume, tier 0, tier 2 and events. It holds no policy of its own: each part is
built from its own config (:mod:`tierckpt.config`) and owns its lifecycle.

Lifecycle (every rank calls every method; each is collective)::

    with CheckpointManager(tier1="/local/ckpt") as ckpt:     # lock, discover, clean up
        info = ckpt.restore(state)                            # None on a fresh start
        ...
        handle = ckpt.save(step, state)                       # blocks only for staging
    # close(): waits for the in-flight save, raises its error, releases the lock

Background errors surface at the next ``save()``, ``wait()`` or ``close()`` on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

from tierckpt.config import ManagerConfig, resolve
from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.format import layout
from tierckpt.heal import regroup, survivor
from tierckpt.policy.interval import AutoInterval, Every
from tierckpt.preempt.config import Preemption
from tierckpt.preempt.session import PreemptSession, resolve_grace
from tierckpt.restore.loader import RestoreInfo
from tierckpt.restore.restorer import Restorer
from tierckpt.restore.verify import Verify
from tierckpt.runtime import events
from tierckpt.runtime.cadence import Cadence
from tierckpt.runtime.save_cost import SaveCostMeter
from tierckpt.runtime.steps import StepMarks
from tierckpt.runtime.topology import Comm, discover_domains
from tierckpt.save.config import Failures, OnSaveError, Staging, Writes
from tierckpt.save.gate import StagingGate
from tierckpt.save.inflight import InFlight
from tierckpt.save.retention import Tier1Retention
from tierckpt.save.saver import AsyncSaver, SaveHandle, SaveJob, SaveResult
from tierckpt.save.staging import HostStager
from tierckpt.state import TrainState, require_state
from tierckpt.tier0.config import Tier0
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier0.session import Tier0Session
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.session import Tier1Session
from tierckpt.tier2.config import Tier2
from tierckpt.tier2.link import Tier2Link

_log = logging.getLogger("tierckpt")

_LEAVE_WAIT_S = 1.0
"""How long a heal waits for the failed generation's in-flight save before abandoning it."""


class CheckpointManager:
    """Async, sharded, committed checkpoints on tier 1 (and tiers 0 and 2) and exact resume.

    Give either a :class:`~tierckpt.config.ManagerConfig` or its fields as keywords (see
    there): ``CheckpointManager(tier1="/local/ckpt")`` or ``CheckpointManager(cfg)``.
    Construct it on every rank after the process group is initialised (or with none for a
    single process). Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, config: ManagerConfig | None = None, *,
                 tier1: str | os.PathLike[str] | None = None, keep_last: int = 3,
                 verify: Verify | str = Verify.SIZES, interval: Every | AutoInterval | None = None,
                 tier0: Tier0 | str | os.PathLike[str] | None = None,
                 tier2: Tier2 | str | None = None,
                 writes: Writes | None = None, failures: Failures | None = None,
                 preemption: Preemption | None = None) -> None:
        self.config = cfg = resolve(config, dict(
            tier1=tier1, keep_last=keep_last, verify=verify, interval=interval, tier0=tier0,
            tier2=tier2, writes=writes, failures=failures, preemption=preemption))
        self._closed = False
        self._catalog = Tier1Catalog(cfg.tier1)
        self._tier1: Tier1Session | None = None
        self._tier0: Tier0Session | None = None
        self._tier2: Tier2Link | None = None
        self._last_result: SaveResult | None = None
        self._preempt: PreemptSession | None = None
        self._state: TrainState | None = None  # the last one restored or saved
        self._seen = -1  # the newest step the loop named (should_save / should_stop)
        self._comm = Comm.create(cfg.failures.collective_timeout_s)
        try:
            self._open(cfg)
        except BaseException:
            self._release(drain=False)
            raise

    def _open(self, cfg: ManagerConfig) -> None:
        """Collective start-up: root, domains, lock, tier 0, tier 2, events, saver."""
        comm, w = self._comm, cfg.writes
        self._catalog.prepare(dir_mode=w.dir_mode, file_mode=w.file_mode)
        self._domains = discover_domains(cfg.tier1, comm)
        self._domain = next(d for d in self._domains if comm.rank in d)
        self._is_owner = self._domain[0] == comm.rank
        self._tier1 = Tier1Session(self._catalog, comm, is_owner=self._is_owner)
        self._tier1.open(file_mode=w.file_mode)
        if cfg.tier0 is not None:
            self._tier0 = Tier0Session(cfg.tier0, tier1=cfg.tier1, comm=comm,
                                       domains=self._domains, domain=self._domain,
                                       is_owner=self._is_owner)
            self._tier0.open(dir_mode=w.dir_mode, file_mode=w.file_mode)
        if cfg.tier2 is not None:
            self._tier2 = Tier2Link(cfg.tier2, catalog=self._catalog, comm=comm,
                                    is_owner=self._is_owner)
            self._tier2.probe(dir_mode=w.dir_mode)
        self._events = events.EventLog(cfg.tier1 / layout.EVENTS, rank=comm.rank,
                                       mode=w.file_mode)
        self.run_id: str = comm.broadcast(uuid.uuid4().hex[:12])
        """This incarnation's id (part of every save id)."""
        roots = [self._catalog] + ([self.tier0.own] if self.tier0 is not None else [])
        mine = [s for r in roots for s in r.complete_steps()[:1]] if self._is_owner else []
        newest = max(comm.all_gather(max(mine, default=-1)))
        self.last_committed: int | None = None if newest < 0 else newest
        """The newest committed step this job knows of (None: none yet)."""
        if self._tier2 is not None:
            self._tier2.start(cfg.retention, self._events, file_mode=w.file_mode,
                              dir_mode=w.dir_mode)
        self._stager = HostStager()
        self._gate = StagingGate(self._events)
        self._inflight = InFlight(cfg.failures, self._events)
        self._steps = StepMarks(self._events, SaveCostMeter(self._events))
        self._cadence = None if cfg.interval is None else Cadence(
            cfg.interval, comm, self._events, cfg.tier1 / layout.EVENTS)
        if self._cadence is None:
            self._gate.on_step = lambda: self._steps.completed(busy=self._saving())
        self._saver = AsyncSaver(cfg.tier1, w, comm, self._domains, self._events,
                                 on_committed=Tier1Retention(
                                     self._catalog, cfg.retention, uploader=cfg.tier2 is not None,
                                     log=self._events), tier0=self.tier0,
                                 tier0_config=cfg.tier0, tier0_fits=None if self._tier0 is None
                                 else functools.partial(self._tier0.check_budget,
                                                        log=self._events))
        if cfg.preemption is not None:
            grace = comm.broadcast(resolve_grace(cfg.preemption) if comm.rank == 0 else None)
            self._preempt = PreemptSession(
                cfg.preemption, store=comm.store(), rank=comm.rank,
                world_size=comm.world_size, run_id=self.run_id, log=self._events,
                events_path=cfg.tier1 / layout.EVENTS, grace=grace)

    @property
    def tier0(self) -> Tier0Root | None:
        """This node's tier 0 (None: off, or turned off because it did not fit)."""
        return self._tier0.root if self._tier0 is not None else None

    # -- public API -----------------------------------------------------------------------
    def restore(self, state: TrainState) -> RestoreInfo | None:
        """Load the newest complete, verified checkpoint into ``state`` (collective).

        Returns None on a fresh start (no checkpoint anywhere). Candidates that fail
        verification — or that verify and then fail while their data is read — are
        quarantined with a logged reason and the next older one is used; every entry newer
        than the agreed step is quarantined too ("newer than the agreed restore point"), so
        the next ``save()`` of those steps works. Tier 2 is consulted with a deadline
        (``Tier2.timeout_s``) and never blocks a restore from tier 1. See
        :class:`tierckpt.restore.restorer.Restorer`.
        """
        self._check_open()
        require_state(state)
        self._gate.settle()  # no background copy may read what the restore overwrites
        cfg, down = self.config, self._tier2.down if self._tier2 is not None else None
        info = Restorer(self._catalog, self._comm, self._domain, verify=cfg.verify,
                        is_owner=self._is_owner, log=self._events, tier2=cfg.tier2,
                        tier2_down=down, writes=cfg.writes, tier0=self.tier0,
                        domains=self._domains).restore(state)
        self.last_committed = None if info is None else info.step
        self._steps.anchor(-1 if info is None else info.step)  # the loop goes on from here
        self._gate.watch(state.optimizer)  # its steps are the marks until save() names one
        self._state, self._seen = state, -1
        regroup.mark_ready()  # under the heal launcher: this rank's generation is loaded
        return info

    def heal(self, state: TrainState, error: BaseException,
             rebuild: Callable[[], None] | None = None) -> RestoreInfo:
        """After a peer died under ``tierckpt run --heal``: keep this process, join the
        launcher's next generation with the replacement, and load the newest complete
        checkpoint into ``state`` in place, as :meth:`restore` does (collective with the
        survivors and the replacement, whose ``restore()`` is this call's other side).
        Returns what ``restore`` returns; go on from its step + 1, with a fresh iterator
        over the loader (its position was restored). With no complete checkpoint yet the
        heal fails: the survivors' state is past the start, and only a full restart can
        begin again from nothing.

        ``error`` is what the training step raised. It is raised again, unchanged, when this
        process cannot heal: not started by the heal launcher, or not a ``RuntimeError`` (a
        failed collective is one; a ConfigError is not). ``rebuild`` runs once the new group
        exists, before this manager reopens on it: wrap a DDP module again there (FSDP2
        modules follow the new group by themselves). Raises HealError when the heal fails
        (no next generation, a group that does not form, a state that does not load): let
        the process exit, and the launcher restarts the whole job, which resumes from the
        newest complete checkpoint as always. Events: ``heal_begin``, ``heal_done`` or
        ``heal_failed``."""
        return survivor.heal(survivor.Manager(
            leave=self._leave_generation, reopen=self._reopen, restore=self.restore,
            log=lambda: self._events, tier1=self.config.tier1), state, error, rebuild)

    def save(self, step: int, state: TrainState) -> SaveHandle:
        """Stage ``state`` into host buffers (see :class:`~tierckpt.save.config.Staging`),
        then write and commit it in the background; the blocked time is C
        (``handle.staged``, the ``save_staged`` event). Waits first for a previous save
        still in flight (an ``overlap`` event) and raises its :class:`SaveError` if it
        failed, or logs it per :class:`~tierckpt.save.config.Failures`. A previous save
        still writing after ``wait_timeout_s`` never gets its host buffers taken: the new
        save raises (or, in continue mode, is skipped: its handle holds the error)."""
        self._check_open()
        require_state(state)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"save(step=...) must be an int >= 0, got {step!r}")
        self._state = state
        self._gate.settle()
        previous, skip = self._inflight.settle()
        self._note(previous)
        if skip is not None:
            return self._inflight.skipped(step, skip)
        if self._tier2 is not None:
            self._tier2.check(
                raise_error=self.config.failures.on_save_error is OnSaveError.RAISE)
        if self.last_committed is not None and step <= self.last_committed:
            raise ConfigError(
                f"save(step={step}) but step {self.last_committed} is already committed in "
                f"{self.config.tier1}; steps must increase (resume with restore() first, or "
                "use a new tier1 directory)")
        t0 = time.monotonic()
        state.step = step
        defer = state.overlap_filter() if self.config.writes.staging is Staging.OVERLAP else None
        self._gate.watch(state.optimizer)  # waits for overlapped copies; marks steps
        staged = self._stager.stage(state.state_dict(), defer=defer)
        staged_at = time.monotonic()
        nbytes = staged.nbytes
        handle = SaveHandle(step=step, staged=Future(), durable=Future())
        self._gate.begin(step=step, blocked_s=staged_at - t0, nbytes=nbytes,
                         deferred_bytes=staged.deferred_bytes, ready=staged.ready,
                         staged=handle.staged)
        try:
            to_tier1 = self._saver.to_tier1(nbytes)
        except BaseException:
            self._gate.settle()  # the buffers are not handed to a writer: let go
            raise
        self._inflight.handle = handle
        self._saver.submit(SaveJob(step=step, staged=staged.tree, nbytes=nbytes,
                                save_id=f"{self.run_id}-{step}", started=t0,
                                staged_at=staged_at, to_tier1=to_tier1,
                                ready=staged.ready), handle)
        self._steps.saving(step, t0)
        if self._cadence is not None:
            self._cadence.saved(step)
        return handle

    def wait_for_staging(self) -> None:
        """Block until the last save's background copies (``Staging.OVERLAP``) landed —
        what the step pre-hook on ``state.optimizer`` does. Call it before writing the
        parameters or optimizer state anywhere other than ``optimizer.step()``."""
        self._gate.settle()

    def should_save(self, step: int) -> bool:
        """Whether to save after ``step`` under ``interval=`` (cheap: call it every step;
        see :class:`tierckpt.runtime.cadence.Cadence`); always False without an interval
        (the loop decides itself) — except at the step agreed after a termination notice,
        True with or without one. The README loop:
        ``if ckpt.should_save(step): ckpt.save(step, state)``."""
        self._seen = max(self._seen, step)
        urgent = self._preempt is not None and self._preempt.should_save(step)
        if self._cadence is None:
            return urgent
        self._steps.completed(busy=self._saving(), step=step)
        return self._cadence.should_save(step) or urgent

    def should_stop(self, step: int) -> bool:
        """True once every rank reached the step agreed after a termination notice (a
        signal, the trigger file, a poller: :class:`~tierckpt.preempt.config.Preemption`)
        and its emergency save is committed and carried as far as the grace allows: leave
        the loop then; ``close()`` ends the process with ``Preemption.exit_code``. Call it
        every step, after ``should_save``/``save``; the first call arms the notice signals
        (before it they act as they did without tierckpt). Saves ``step`` itself if the
        loop did not. Collective at the agreed step; cheap otherwise."""
        self._check_open()
        self._seen = max(self._seen, step)
        p = self._preempt
        if p is None or not p.at_stop(step):
            return False
        if p.carry is None:
            h = self._inflight.handle
            if h is None or h.step != step:
                if self._state is None:
                    raise ConfigError("should_stop() has no state to save: call "
                                      "restore(state) or save(step, state) first")
                self.save(step, self._state)
            result = self.wait() or self._last_result
            assert result is not None and result.step == step
            p.carry_save(step, nbytes=result.bytes_total, tier=result.tier,
                         tier0=self.tier0 is not None, tier2=self._tier2 is not None,
                         flush=lambda: self._saver.flush_to_tier1(result),
                         request_upload=self._catalog.request_upload if self._is_owner
                         else lambda s: None)
        return True

    def _saving(self) -> bool:
        """A save is still in flight (not yet committed or failed)."""
        h = self._inflight.handle
        return h is not None and not h.done()

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the in-flight save (if any) is committed; raise its error."""
        self._check_open()
        self._gate.settle()
        return self._note(self._inflight.finish(record_overlap=False, timeout=timeout))

    def close(self, *, after_error: bool = False) -> None:
        """Wait for the in-flight save, release the lock and the checkpoint group;
        idempotent; raises the in-flight save's error after releasing everything.

        A clean close keeps the run's work: when the loop named a step (``should_save`` or
        ``should_stop``) past the newest save, that step is saved first (a ``final_save``
        event; the state is the one last restored or saved). The newest save, if in RAM
        only, is copied to tier 1, and with tier 2 it is asked for by name whatever
        ``upload_every`` says: the uploader gets ``Tier2.drain_s`` to copy it before this
        returns. ``after_error=True`` (leaving a ``with`` block on an exception) skips all
        of that: other ranks may be gone, and the uploader resumes from its records."""
        if self._closed:
            return
        if not after_error:
            try:
                self._final_save()
            except BaseException:
                self.close(after_error=True)
                raise
        self._closed = True
        try:
            self._gate.close()
            self._note(self._inflight.finish(record_overlap=False))
            last, p = self._last_result, self._preempt
            if not after_error and last is not None and (p is None or p.carry is None):
                if last.tier == "tier0" and self.tier0 is not None:
                    self._saver.flush_to_tier1(last)
                if self._tier2 is not None and self._is_owner:
                    self._catalog.request_upload(last.step)  # the drain below copies it
        finally:
            self._saver.close(wait=not self._inflight.stuck)  # bounded: abandon a stuck write
            self._stager.close()
            self._release(drain=not after_error)
        if p is not None and p.carry is not None and p.config.exit_code and not after_error:
            raise SystemExit(p.config.exit_code)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(CheckpointError):  # don't mask the original exception
            self.close(after_error=True)

    # -- internals ------------------------------------------------------------------------
    def _final_save(self) -> None:
        """At a clean close: save the loop's newest named step if no save covers it yet
        (collective: every rank named the same steps). After a notice the emergency save
        is the final one."""
        p, h = self._preempt, self._inflight.handle
        last = max(-1 if h is None else h.step, -1 if self.last_committed is None
                   else self.last_committed)
        if self._seen <= last or (p is not None and p.carry is not None):
            return
        if self._state is None:  # should_save() without restore()/save(): nothing to save
            _log.warning("close(): the loop ran to step %d but no state was ever restored "
                         "or saved; steps after %d are not saved", self._seen, last)
            return
        _log.info("close(): saving step %d, the loop's last (the newest save was %s)",
                  self._seen, last if last >= 0 else "none")
        self._events.emit(events.FINAL_SAVE, step=self._seen, last_saved=last)
        self.save(self._seen, self._state)

    def _reopen(self) -> None:
        """After a heal re-formed the group: open this manager again on it."""
        self._comm = Comm.create(self.config.failures.collective_timeout_s)
        self._closed = False
        self._open(self.config)

    def _leave_generation(self) -> None:
        """Let go of everything bound to the failed generation's groups, as a close after an
        error does. The in-flight save gets ``_LEAVE_WAIT_S`` to end (its collectives fail
        with the dead peer), then is abandoned: a coordinator waiting in a gather for the
        dead rank's part is not woken by an abort (gloo's receive waits out its timeout),
        and it can never commit — no survivor answers the old group again — so it ends in
        its own ``save_failed`` and its tmp directory is debris the next start removes."""
        self._closed = True
        self._gate.close()
        with contextlib.suppress(CheckpointError):  # it failed with the peer: expected
            self._inflight.finish(record_overlap=False, timeout=_LEAVE_WAIT_S)
        try:
            self._saver.close(wait=not self._inflight.stuck)
            self._stager.close()
        finally:
            self._release(drain=False, closing=False)
        self._inflight.handle, self._inflight.stuck = None, False

    def _note(self, result: SaveResult | None) -> SaveResult | None:
        if result is not None:
            self.last_committed = max(self.last_committed or -1, result.step)
            self._last_result = result
        return result

    def _release(self, *, drain: bool, closing: bool = True) -> None:
        p, left = self._preempt, None
        if self._tier2 is not None:  # drains what is due, bounded (by the grace after a notice)
            c = p.carry if p is not None else None
            left = self._tier2.close(drain=drain, drain_s=c.drain_s if c else None)
        if p is not None:
            p.finish(tier2_left=left)
            p.close()
        if closing and getattr(self, "_events", None) is not None:
            # a launcher tells a finished job from one cut short by this (not by a heal)
            self._events.emit(events.MANAGER_CLOSED, clean=drain,
                              stopped=p is not None and p.carry is not None,
                              step=self.last_committed)
        if self._tier1 is not None:
            self._tier1.release()
        if self._tier0 is not None:
            self._tier0.release(clean=drain)
        if getattr(self, "_events", None) is not None:
            self._events.close()
        self._comm.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
