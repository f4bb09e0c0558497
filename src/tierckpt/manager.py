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
import logging
import os
from collections.abc import Callable

from tierckpt.config import ManagerConfig, resolve
from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.generation import Generation
from tierckpt.heal import regroup, survivor
from tierckpt.policy.interval import AutoInterval, Every
from tierckpt.preempt.config import Preemption
from tierckpt.restore.loader import RestoreInfo
from tierckpt.restore.restorer import Restorer
from tierckpt.restore.verify import Verify
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm
from tierckpt.save.config import Failures, OnSaveError, Staging, Writes
from tierckpt.save.saver import SaveHandle, SaveResult
from tierckpt.state import TrainState, require_state
from tierckpt.tier0.config import Tier0
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.config import Tier2

_log = logging.getLogger("tierckpt")


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
        self._catalog = Tier1Catalog(cfg.tier1)
        self._last_result: SaveResult | None = None
        self._state: TrainState | None = None  # the last one restored or saved
        self._seen = -1  # the newest step the loop named (should_save / should_stop)
        self._open()

    def _open(self) -> None:
        """Open a generation on a new checkpoint group (collective; see
        :class:`~tierckpt.generation.Generation`)."""
        self._g = g = Generation(self.config, self._catalog,
                                 Comm.create(self.config.failures.collective_timeout_s))
        self._closed = False
        self.run_id: str = g.run_id
        """This incarnation's id (part of every save id)."""
        self.last_committed: int | None = g.newest
        """The newest committed step this job knows of (None: none yet)."""

    @property
    def tier0(self) -> Tier0Root | None:
        """This node's tier 0 (None: off, or turned off because it did not fit)."""
        return self._g.tier0

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
        g, cfg = self._g, self.config
        g.gate.settle()  # no background copy may read what the restore overwrites
        info = Restorer(self._catalog, g.comm, g.domain, verify=cfg.verify,
                        is_owner=g.is_owner, log=g.log, tier2=cfg.tier2,
                        tier2_down=g.tier2.down if g.tier2 is not None else None,
                        writes=cfg.writes, tier0=g.tier0, domains=g.domains).restore(state)
        self.last_committed = None if info is None else info.step
        g.steps.anchor(-1 if info is None else info.step)  # the loop goes on from here
        g.gate.watch(state.optimizer)  # its steps are the marks until save() names one
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
            leave=self._leave, reopen=self._open, restore=self.restore,
            log=lambda: self._g.log, tier1=self.config.tier1), state, error, rebuild)

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
        self._state, g = state, self._g
        g.gate.settle()
        previous, skip = g.inflight.settle()
        self._note(previous)
        if skip is not None:
            return g.inflight.skipped(step, skip)
        if g.tier2 is not None:
            g.tier2.check(raise_error=self.config.failures.on_save_error is OnSaveError.RAISE)
        if self.last_committed is not None and step <= self.last_committed:
            raise ConfigError(
                f"save(step={step}) but step {self.last_committed} is already committed in "
                f"{self.config.tier1}; steps must increase (resume with restore() first, or "
                "use a new tier1 directory)")
        return g.submit(step, state, overlap=self.config.writes.staging is Staging.OVERLAP)

    def wait_for_staging(self) -> None:
        """Block until the last save's background copies (``Staging.OVERLAP``) landed —
        what the step pre-hook on ``state.optimizer`` does. Call it before writing the
        parameters or optimizer state anywhere other than ``optimizer.step()``."""
        self._g.gate.settle()

    def should_save(self, step: int) -> bool:
        """Whether to save after ``step`` under ``interval=`` (cheap: call it every step;
        see :class:`tierckpt.runtime.cadence.Cadence`); always False without an interval
        (the loop decides itself) — except at the step agreed after a termination notice,
        True with or without one. The README loop:
        ``if ckpt.should_save(step): ckpt.save(step, state)``."""
        self._seen, g = max(self._seen, step), self._g
        urgent = g.preempt is not None and g.preempt.should_save(step)
        if g.cadence is None:
            return urgent
        g.steps.completed(busy=g.saving(), step=step)
        return g.cadence.should_save(step) or urgent

    def should_stop(self, step: int) -> bool:
        """True once every rank reached the step agreed after a termination notice (a
        signal, the trigger file, a poller: :class:`~tierckpt.preempt.config.Preemption`)
        and its emergency save is committed and carried as far as the grace allows: leave
        the loop then; ``close()`` ends the process with ``Preemption.exit_code``. Call it
        every step, after ``should_save``/``save``; the first call arms the notice signals
        (before it they act as they did without tierckpt). Saves ``step`` itself if the
        loop did not. Collective at the agreed step; cheap otherwise."""
        self._check_open()
        self._seen, p = max(self._seen, step), self._g.preempt
        if p is None or not p.at_stop(step):
            return False
        if p.carry is None:
            h = self._g.inflight.handle
            if h is None or h.step != step:
                if self._state is None:
                    raise ConfigError("should_stop() has no state to save: call "
                                      "restore(state) or save(step, state) first")
                self.save(step, self._state)
            result = self.wait() or self._last_result
            assert result is not None and result.step == step
            self._g.carry(step, result)
        return True

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the in-flight save (if any) is committed; raise its error."""
        self._check_open()
        self._g.gate.settle()
        return self._note(self._g.inflight.finish(record_overlap=False, timeout=timeout))

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
        self._closed, g = True, self._g
        p = g.preempt
        try:
            g.gate.close()
            self._note(g.inflight.finish(record_overlap=False))
            if not after_error and self._last_result is not None \
                    and (p is None or p.carry is None):
                g.keep(self._last_result)
        finally:
            g.stop_writing()
            g.release(drain=not after_error, step=self.last_committed)
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
        p, h = self._g.preempt, self._g.inflight.handle
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
        self._g.log.emit(events.FINAL_SAVE, step=self._seen, last_saved=last)
        self.save(self._seen, self._state)

    def _leave(self) -> None:
        """A heal lets go of the failed generation (:meth:`Generation.leave`)."""
        self._closed = True
        self._g.leave()

    def _note(self, result: SaveResult | None) -> SaveResult | None:
        if result is not None:
            self.last_committed = max(self.last_committed or -1, result.step)
            self._last_result = result
        return result

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
