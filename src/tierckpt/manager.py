"""``CheckpointManager``: the facade that composes staging, the async saver, commit,
retention, resume and events. It holds no policy of its own.

Lifecycle (every rank calls every method; each is collective)::

    with CheckpointManager(tier1=..., keep_last=3) as ckpt:   # lock, discover, clean up
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
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tierckpt.config import ManagerConfig, OnSaveError
from tierckpt.errors import (
    CheckpointError,
    ConfigError,
    LockError,
    SaveError,
)
from tierckpt.format import layout
from tierckpt.restore.loader import RestoreInfo
from tierckpt.restore.restorer import Restorer
from tierckpt.runtime import events
from tierckpt.runtime.cadence import Cadence
from tierckpt.runtime.deadline import call_with_deadline
from tierckpt.runtime.save_cost import SaveCostMeter
from tierckpt.runtime.topology import Comm, discover_domains
from tierckpt.save.gate import StagingGate
from tierckpt.save.inflight import InFlight
from tierckpt.save.saver import AsyncSaver, SaveHandle, SaveJob, SaveResult
from tierckpt.save.staging import HostStager
from tierckpt.state import TrainState
from tierckpt.tier0.replicate import ring as replicate_ring
from tierckpt.tier0.root import Tier0Root, auto_base, default_root, remove_dead_roots
from tierckpt.tier0.root import budget as tier0_budget
from tierckpt.tier1 import fs
from tierckpt.tier1.catalog import Tier1Catalog, read_committed
from tierckpt.tier1.lock import FileLock
from tierckpt.tier2 import probe
from tierckpt.tier2.storage.url import parse_url
from tierckpt.tier2.uploader import UploaderConfig
from tierckpt.tier2.uploader.supervisor import UploaderSupervisor

_log = logging.getLogger("tierckpt")


class CheckpointManager:
    """Async, sharded, committed checkpoints on tier 1 and exact resume.

    Keyword arguments are those of :class:`tierckpt.config.ManagerConfig` (``tier1`` is
    required). Construct it on every rank after the process group is initialised (or with
    none for a single process). Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, *, config: ManagerConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            if "tier1" not in kwargs:
                raise ConfigError("CheckpointManager needs tier1=<directory for checkpoints>")
            config = ManagerConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either config= or keyword arguments, not both")
        self.config = cfg = config
        self._closed = False
        self.catalog = Tier1Catalog(cfg.tier1)
        self._lock: FileLock | None = None
        self._tier0_lock: FileLock | None = None
        self._last_result: SaveResult | None = None
        self._uploader: UploaderSupervisor | None = None
        self.comm = Comm.create(cfg.collective_timeout_s)
        try:
            self._prepare_root()
            self.domains = discover_domains(cfg.tier1, self.comm)
            self.domain = next(d for d in self.domains if self.comm.rank in d)
            self.is_owner = self.domain[0] == self.comm.rank
            self._take_lock_and_clean()
            self.tier0 = self._open_tier0()
            tier2_options = self._probe_tier2()
            self.log = events.EventLog(cfg.tier1 / layout.EVENTS, rank=self.comm.rank,
                                       mode=cfg.file_mode)
            self.run_id = self.comm.broadcast(uuid.uuid4().hex[:12])
            existing = self.catalog.complete_steps() if self.is_owner else []
            if self.is_owner and self.tier0 is not None:
                existing = sorted({*existing, *self.tier0.own.complete_steps()}, reverse=True)
            newest = max(self.comm.all_gather(existing[0] if existing else -1))
            self.last_committed: int | None = None if newest < 0 else newest
            self._uploader = self._start_uploader(tier2_options)
            self._stager = HostStager()
            self._gate = StagingGate(self.log)
            self._inflight = InFlight(cfg, self.log)
            # a save's whole cost (runtime.save_cost) from step marks: should_save() gives
            # them under interval=, else every step of the state's optimizer does
            self._meter = SaveCostMeter(self.log)
            self._cadence = None if cfg.interval is None else Cadence(
                cfg.interval, self.comm, self.log, cfg.tier1 / layout.EVENTS)  # type: ignore[arg-type]
            if self._cadence is None:
                self._gate.on_step = lambda: self._meter.mark(busy=self._saving())
            self._saver = AsyncSaver(cfg, self.comm, self.domains, self.log,
                                     on_committed=self._apply_retention, tier0=self.tier0)
            self._saves = 0  # this incarnation's saves: every tier1_every-th goes to tier 1
            self._tier0_checked = False
        except BaseException:
            self._release()
            raise

    # -- public API -----------------------------------------------------------------------
    def restore(self, state: TrainState) -> RestoreInfo | None:
        """Load the newest complete, verified checkpoint into ``state`` (collective).

        Returns None on a fresh start (no checkpoint anywhere). Candidates that fail
        verification — or that verify and then fail while their data is read — are
        quarantined with a logged reason and the next older one is used; every entry newer
        than the agreed step is quarantined too ("newer than the agreed restore point"), so
        the next ``save()`` of those steps works. Tier 2 is consulted with a deadline
        (``tier2_timeout_s``) and never blocks a restore from tier 1. See
        :class:`tierckpt.restore.restorer.Restorer`.
        """
        self._check_open()
        _require_state(state)
        self._gate.settle()  # no background copy may read what the restore overwrites
        info = Restorer(self.config, self.catalog, self.comm, self.domain,
                        is_owner=self.is_owner, log=self.log, tier0=self.tier0,
                        domains=self.domains).restore(state)
        self.last_committed = None if info is None else info.step
        return info

    def save(self, step: int, state: TrainState) -> SaveHandle:
        """Stage ``state`` into host buffers, then write and commit it in the background.
        With ``staging="overlap"`` (the default, when ``state`` has an optimizer) only
        buffers and small state are copied before this returns; parameters and optimizer
        state are copied during the next forward/backward, and ``state.optimizer.step()``
        waits for that copy (see :mod:`tierckpt.save.gate`); ``"sync"`` copies everything
        first. The blocked time is C (``handle.staged``, the ``save_staged`` event).
        Waits first for a previous save still in flight (an ``overlap`` event records the
        wait) and raises its :class:`SaveError` if it failed — with
        ``on_save_error="continue"``, logs it instead, until ``max_consecutive_save_failures``
        saves in a row have failed. A previous save still writing after ``wait_timeout_s``
        is never given the host buffers it reads: the new save raises (or, in continue mode,
        is skipped: its handle holds the error) until the stuck one ends."""
        self._check_open()
        _require_state(state)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"save(step=...) must be an int >= 0, got {step!r}")
        self._gate.settle()
        previous, skip = self._inflight.settle()
        self._note(previous)
        if skip is not None:
            return self._inflight.skipped(step, skip)
        self._watch_tier2()
        if self.last_committed is not None and step <= self.last_committed:
            raise ConfigError(
                f"save(step={step}) but step {self.last_committed} is already committed in "
                f"{self.config.tier1}; steps must increase (resume with restore() first, or "
                "use a new tier1 directory)")
        t0 = time.monotonic()
        state.step = step
        defer = state.overlap_filter() if self.config.staging == "overlap" else None
        if state.optimizer is not None:  # waits for overlapped copies; marks steps
            self._gate.watch(state.optimizer)
        staged = self._stager.stage(state.state_dict(), defer=defer)
        staged_at = time.monotonic()
        nbytes = staged.nbytes
        to_tier1 = self.tier0 is None or self._saves % self.config.tier1_every == 0
        handle = SaveHandle(step=step, staged=Future(), durable=Future())
        self._gate.begin(step=step, blocked_s=staged_at - t0, nbytes=nbytes,
                         deferred_bytes=staged.deferred_bytes, ready=staged.ready,
                         staged=handle.staged)
        if self.tier0 is not None and not self._tier0_checked:
            try:
                self._check_tier0_budget(nbytes)
            except BaseException:
                self._gate.settle()  # the buffers are not handed to a writer: let go
                raise
        self._saves += 1
        self._inflight.handle = handle
        self._saver.submit(SaveJob(step=step, staged=staged.tree, nbytes=nbytes,
                                save_id=f"{self.run_id}-{step}", started=t0,
                                staged_at=staged_at, to_tier1=to_tier1,
                                ready=staged.ready), handle)
        self._meter.saving(step, t0)
        if self._cadence is not None:
            self._cadence.saved(step)
        return handle

    def wait_for_staging(self) -> None:
        """Block until the last save's background copies (``staging="overlap"``) landed —
        what the step pre-hook on ``state.optimizer`` does. Call it before writing the
        parameters or optimizer state anywhere other than ``optimizer.step()``."""
        self._gate.settle()

    def should_save(self, step: int) -> bool:
        """Whether to save after ``step`` under ``interval=`` (cheap: call it every step;
        see :class:`tierckpt.runtime.cadence.Cadence`). The README loop:
        ``if ckpt.should_save(step): ckpt.save(step, state)``."""
        if self._cadence is None:
            raise ConfigError("should_save() needs CheckpointManager(interval=...): "
                              "tierckpt.Every(steps=500), Every(seconds=600) or "
                              "tierckpt.AutoInterval(node_mtbf='30d')")
        self._meter.mark(busy=self._saving())
        return self._cadence.should_save(step)

    def _saving(self) -> bool:
        """A save is still in flight (not yet committed or failed)."""
        h = self._inflight.handle
        return h is not None and not h.done()

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the in-flight save (if any) is committed; raise its error."""
        self._check_open()
        self._gate.settle()
        return self._finish_inflight(record_overlap=False, timeout=timeout)

    def close(self, *, after_error: bool = False) -> None:
        """Wait for the in-flight save, release the lock and the checkpoint group.
        Idempotent. Raises the in-flight save's error (after releasing everything). With
        tier 0, the newest save when it lives in RAM only is first copied to tier 1
        (collective); the uploader gets ``upload_drain_s`` to copy what is due.
        ``after_error=True`` (what leaving a ``with`` block on an exception does) skips
        both: other ranks may be gone, and a restart should not wait for the drain (the
        uploader resumes from its records)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._gate.close()
            self._finish_inflight(record_overlap=False)
            last = self._last_result
            if not after_error and last is not None and last.tier == "tier0" \
                    and self.tier0 is not None:
                self._flush_tier0(last)
        finally:
            self._saver.close(wait=not self._inflight.stuck)  # bounded: abandon a stuck write
            self._stager.close()
            self._release(drain_s=0.0 if after_error else self.config.upload_drain_s)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(CheckpointError):  # don't mask the original exception
            self.close(after_error=True)

    # -- internals ------------------------------------------------------------------------
    def _open_tier0(self) -> Tier0Root | None:
        """Collective: every owner opens its node's tier 0 (``tier0=`` config). With
        ``"auto"`` a node that cannot (no tmpfs, another job's directory) turns tier 0 off
        for the whole job with a warning; with a path it is a ConfigError everywhere."""
        cfg = self.config
        if cfg.tier0 is None:
            return None
        path = default_root(cfg.tier1) if cfg.tier0_auto else Path(cfg.tier0)  # type: ignore[arg-type]
        root, err = Tier0Root(path=path, tier1=cfg.tier1), None
        if self.is_owner:
            try:
                if cfg.tier0_auto:
                    remove_dead_roots(auto_base(), keep=path)
                self._tier0_lock = root.open(dir_mode=cfg.dir_mode, file_mode=cfg.file_mode)
            except (ConfigError, LockError, OSError) as e:
                err = f"rank {self.comm.rank}: {e}"
        paths = self.comm.all_gather(str(path))
        if len({paths[r] for r in self.domain}) > 1:
            err = err or (f"ranks {list(self.domain)} share tier1 {cfg.tier1} but not tier0 "
                          f"({sorted({paths[r] for r in self.domain})}); give the ranks of a "
                          "node one tier0 directory")
        errors = [e for e in self.comm.all_gather(err) if e]
        if not errors:
            return root
        if cfg.tier0_auto:
            self._release_tier0()
            _log.warning("tier0='auto': running without tier 0: %s", errors[0])
            return None
        self._release_tier0()
        raise ConfigError(errors[0])

    def _check_tier0_budget(self, nbytes: int) -> None:
        """Collective, at the first save: tier 0's RAM need (own + partner's replica, x
        ``tier0_keep`` + 1 while a new one commits) against the tmpfs and host RAM."""
        cfg = self.config
        self._tier0_checked = True
        sizes = self.comm.all_gather(nbytes)
        own = sum(sizes[r] for r in self.domain)
        ring_ = replicate_ring(self.domains, self.domain) if cfg.tier0_replicate else None
        peer = sum(sizes[r] for r in ring_[1]) if ring_ is not None else 0
        need = int((cfg.tier0_keep + 1) * (own + peer) * 1.02)  # + headers, .metadata
        msg = None
        if self.is_owner and self.tier0 is not None:
            b = tier0_budget(self.tier0.path, need)
            if not b.fits:
                msg = f"rank {self.comm.rank}: {b.message(self.tier0.path)}"
        errors = [m for m in self.comm.all_gather(msg) if m]
        if not errors:
            return
        if not cfg.tier0_auto:
            raise ConfigError(errors[0])
        self.log.emit(events.TIER0_DISABLED, reason=errors[0])
        _log.warning("tier0='auto': running without tier 0: %s", errors[0])
        self.tier0 = self._saver.tier0 = None
        self._release_tier0()

    def _flush_tier0(self, last: SaveResult) -> None:
        """Collective, at close: the newest save lives in RAM only; copy it to tier 1 so
        the run's last state outlives the node (and reaches tier 2)."""
        path = last.path
        committed = read_committed(path, step=last.step) if self.is_owner else None
        self._saver.copy_to_tier1(committed, path)
        self.log.emit(events.SAVE_COMMITTED, step=last.step, seconds=0.0, write_seconds=0.0,
                      bytes=last.bytes_total, tier="tier1", flushed=True)
        if self.is_owner:
            for p in self._apply_retention(last):
                with contextlib.suppress(OSError):
                    fs.remove_tree(p)

    def _release_tier0(self) -> None:
        if self._tier0_lock is not None:
            self._tier0_lock.release()
            self._tier0_lock = None

    def _watch_tier2(self) -> None:
        """At each save: the domain owners' supervisors restart a dead uploader and report a
        failing tier 2. With ``tier2_required`` a failing tier 2 is a SaveError on every
        rank (logged instead with ``on_save_error="continue"``)."""
        cfg = self.config
        health = self._uploader.check() if self._uploader is not None else None
        if not cfg.tier2_required:
            return
        err = None if health is None or health.healthy else \
            f"rank {self.comm.rank}: tier 2 {cfg.tier2} is failing: {health.error}"
        errors = [e for e in self.comm.all_gather(err) if e]
        if not errors:
            return
        failure = SaveError(f"tier2_required and {'; '.join(errors)}")
        if cfg.on_save_error is OnSaveError.RAISE:
            raise failure
        _log.error("%s (on_save_error=continue)", failure)

    def _finish_inflight(self, *, record_overlap: bool,
                         timeout: float | None = None) -> SaveResult | None:
        result = self._inflight.finish(record_overlap=record_overlap, timeout=timeout)
        self._note(result)
        return result

    def _note(self, result: SaveResult | None) -> None:
        if result is not None:
            self.last_committed = max(self.last_committed or -1, result.step)
            self._last_result = result

    def _apply_retention(self, result: SaveResult) -> list[Path]:
        """Unpublish what tier-1 retention drops; return the directories to reclaim. With a
        tier 2 configured, what the uploader has yet to copy is kept."""
        plan = self.catalog.retention_plan(self.config.retention,
                                           uploader=self.config.tier2 is not None)
        for step in plan.released:  # the disk stays bounded while tier 2 is down
            reason = (f"more than upload_backlog={self.config.upload_backlog} checkpoints "
                      "wait for tier 2")
            self.log.emit(events.UPLOAD_SKIPPED, step=step, reason=reason)
            _log.warning("step %d leaves tier 1 without reaching tier 2: %s", step, reason)
        return [self.catalog.unpublish(step) for step in plan.delete]

    def _start_uploader(self, s3_options: dict[str, Any]) -> UploaderSupervisor | None:
        cfg = self.config
        if cfg.tier2 and self.is_owner:  # the retention `tierckpt gc` applies to this root
            self.catalog.write_policy(tier2=cfg.tier2, policy=cfg.retention,
                                      file_mode=cfg.file_mode, dir_mode=cfg.dir_mode)
        if not (cfg.tier2 and cfg.start_uploader and self.is_owner):
            return None
        return UploaderSupervisor(UploaderConfig(
            tier1=cfg.tier1, tier2=cfg.tier2, upload_every=cfg.upload_every,
            keep_last=cfg.tier2_keep_last, keep_every=cfg.tier2_keep_every,
            s3_options=s3_options),
            log=self.log).start()

    def _prepare_root(self) -> None:
        root = self.config.tier1
        try:
            root.mkdir(mode=self.config.dir_mode, parents=True, exist_ok=True)
            probe = root / f".writable-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            fs.write_durably(probe, b"", mode=self.config.file_mode)
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"tier1={root} is not a writable directory ({e}); point tier1 at "
                              "a local directory this user can write") from e

    def _probe_tier2(self) -> dict[str, Any]:
        """Collective: probe tier 2 once (owners, bounded by ``tier2_timeout_s``) and return
        the uploader's S3 options for the modes chosen. A tier 2 that can never work
        (missing bucket, refused credentials, no integrity mode, a file:// root that does
        not exist) is a ConfigError now, on every rank; one that does not answer is only a
        warning — an outage must not stop a job that can restore from tier 1 (its uploader
        probes again when it starts)."""
        cfg, err, options = self.config, None, {}
        if cfg.tier2 and self.is_owner:
            url = cfg.tier2
            try:
                result = call_with_deadline(lambda: probe.probe_url(url),
                                            cfg.tier2_timeout_s, f"probing tier 2 {url}")
                self.catalog.write_tier2_probe(result.to_json(), dir_mode=cfg.dir_mode)
                probe.require_usable(result,
                                     conditional_writes=cfg.tier2_require_conditional_writes)
                options = result.s3_options()
                for weaker in result.modes.weaker:
                    _log.warning("tier 2 %s: %s", url, weaker)
            except ConfigError as e:
                if _missing_dir(url):  # an unmounted file system: an outage, not a typo
                    _log.warning("tier 2 %s is not there (%s); starting from tier 1 — mount "
                                 "it: the uploader retries", url, e)
                else:
                    err = str(e)
            except (CheckpointError, OSError) as e:  # TimeoutError is an OSError
                _log.warning("tier 2 %s did not answer the probe (%s); starting anyway", url, e)
        errors = [e for e in self.comm.all_gather(err) if e]
        if errors:
            raise ConfigError(errors[0])
        return options

    def _take_lock_and_clean(self) -> None:
        err = None
        if self.is_owner:
            try:
                self._lock = self.catalog.lock(self.config.file_mode)
                self.catalog.clean_stale()
            except LockError as e:
                err = str(e)
        errors = [e for e in self.comm.all_gather(err) if e]
        if errors:
            raise LockError(errors[0])

    def _release(self, drain_s: float = 0.0) -> None:
        if getattr(self, "_uploader", None) is not None:
            assert self._uploader is not None
            self._uploader.close(drain_s)  # drains what is due, bounded
            self._uploader = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._release_tier0()
        if getattr(self, "log", None) is not None:
            self.log.close()
        self.comm.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")


def _missing_dir(url: str) -> bool:
    """A ``file://`` tier 2 whose directory does not exist (yet): never created by us, but
    a mount that is down is an outage — the job must still restart from tier 1."""
    if not url.startswith("file://"):
        return False
    return not os.path.lexists(parse_url(url).location)


def _require_state(state: object) -> None:
    if not isinstance(state, TrainState):
        raise ConfigError(f"expected a tierckpt.TrainState, got {type(state).__name__}")
