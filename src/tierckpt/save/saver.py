"""Background writing and committing of staged state: exactly one save in flight.

``AsyncSaver.submit`` hands a staged state dict to a single worker thread that (1) writes
this rank's shard files into the save's tmp directory through DCP with :class:`ShardWriter`
(CRC32C on the same pass, fsync), (2) gathers every rank's file list to rank 0, and (3)
commits through :class:`~tierckpt.save.committer.Committer` (rank 0 seals the manifest,
domain owners commit, every rank agrees on the outcome); with tier 0, (4) replicates the
step to a peer node and copies every ``tier1_every``-th save to tier 1. All collectives
use the manager's dedicated gloo group with its own timeout, so a dead peer turns into an
error, not a hang.

Errors never escape the thread: they complete the handle's ``durable`` future with a
:class:`SaveError`, which the manager raises at the next ``save()``/``wait()``/``close()``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierckpt.errors import DiskFullError, SaveError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm
from tierckpt.save import coordinate
from tierckpt.save.committer import Committer
from tierckpt.save.config import Writes
from tierckpt.save.diskfull import disk_full
from tierckpt.save.writer import FrozenFile, FrozenPlan, ShardWriter
from tierckpt.tier0.config import Tier0
from tierckpt.tier0.pages import RamPages
from tierckpt.tier0.replicate import copy_to_tier1, keep_newest, replicate
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.fs import remove_tree
from tierckpt.tier1.manifests import read_committed

_log = logging.getLogger("tierckpt")

# A single-process job passes no_dist=True on purpose; DCP warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized, assuming the intent is to", category=UserWarning)


TIER0_IO_THREADS = 2
"""Copies into RAM (tier 0) in flight per shard file: a memcpy into tmpfs pages is CPU
work, and one thread leaves a second core idle while the caller checksums."""


def _lower_thread_priority(nice: int) -> None:
    """Raise this thread's niceness by ``nice`` (Linux threads have their own; threads it
    creates — the shard writers — inherit it), so background writing yields to training."""
    if nice > 0:
        with contextlib.suppress(OSError, AttributeError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """A committed checkpoint: where it is, how big, how long the whole save took."""

    step: int
    path: Path
    bytes_total: int
    seconds: float
    write_seconds: float
    manifest: mf.Manifest | None
    """The committed manifest on domain owners (it lists every rank's files: O(W), so it
    goes to the ranks that write it only); None on the other ranks."""
    tier: str = "tier1"
    """Where ``path`` is: ``tier1``, or ``tier0`` for a save kept in RAM only (with tier 0,
    every ``tier1_every``-th save is also committed on tier 1)."""


@dataclasses.dataclass
class SaveHandle:
    """Returned by every ``save()``. ``staged`` resolves to the blocking seconds (C) once
    staging is over — before ``save()`` returns with ``staging="sync"``, when the background
    copies landed (at the latest in the next ``optimizer.step()``) with ``"overlap"``;
    ``durable`` to a :class:`SaveResult` once the checkpoint is committed on every rank (or
    to a :class:`SaveError`)."""

    step: int
    staged: Future[float]
    durable: Future[SaveResult]

    def done(self) -> bool:
        return self.durable.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until committed; raises :class:`SaveError` if the save failed and
        ``TimeoutError`` if it is still writing after ``timeout`` seconds."""
        try:
            return self.durable.result(timeout)
        except cf.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise TimeoutError(f"save of step {self.step} still writing after {timeout} s"
                               ) from None


@dataclasses.dataclass(frozen=True)
class SaveJob:
    """One save handed to :class:`AsyncSaver`: what was staged (host buffers, ``nbytes``),
    under which ``save_id``, and when staging started and ended (monotonic seconds)."""

    step: int
    staged: Any
    nbytes: int
    save_id: str
    started: float
    staged_at: float
    to_tier1: bool = True
    """With tier 0: also copy this save to tier 1 (without tier 0 every save goes there)."""
    ready: Future[float] | None = None
    """Resolves when the background part of staging landed (``staging="overlap"``); the
    writer waits for it, and its error (a tensor changed while copied) fails the save."""
    frozen: frozenset[str] = frozenset()
    """``Writes(incremental=True)``: the DCP keys of the frozen parameters staged."""
    kept: frozenset[str] = frozenset()
    """Those the stager did not copy: unchanged since the previous save."""
    kept_bytes: int = 0


class AsyncSaver:
    """One worker thread; the caller guarantees one job at a time (the manager waits for the
    previous handle before submitting). ``on_committed(result)`` runs on the worker thread of
    domain owners after a successful commit (retention): it unpublishes what it drops and
    returns those directories, which are removed after the handle resolved. A failure there
    is logged, never turned into a failed save."""

    def __init__(self, tier1: Path, writes: Writes, comm: Comm,
                 domains: tuple[tuple[int, ...], ...], log: events.EventLog,
                 on_committed: Callable[[SaveResult], list[Path]] | None = None,
                 tier0: Tier0Root | None = None, tier0_config: Tier0 | None = None,
                 tier0_fits: Callable[[int], bool] | None = None) -> None:
        self.tier1, self.writes, self.comm, self.domains, self.log = \
            tier1, writes, comm, domains, log
        self.tier0_config = tier0_config or Tier0()
        self.on_committed = on_committed
        self.is_owner = any(d[0] == comm.rank for d in domains)
        self.domain = next(d for d in domains if comm.rank in d)
        self.tier0 = tier0
        """Tier 0 of this node (every rank knows the path; its owner manages it)."""
        self._tier0_fits = tier0_fits
        self._pages = None if tier0 is None else RamPages(tier0.free,
                                                          file_mode=writes.file_mode)
        self._routed = 0  # saves routed with tier 0 on: every tier1_every-th reaches tier 1
        self._plans = coordinate.PlanCache()
        self._frozen: FrozenFile | None = None  # the last committed save's frozen file
        self.committer = Committer(comm, domains, file_mode=writes.file_mode)  # collective
        """The commit protocol, with the ``.metadata`` this owner last committed."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-saver",
                                        initializer=_lower_thread_priority,
                                        initargs=(writes.background_nice,))

    def to_tier1(self, nbytes: int) -> bool:
        """Which tiers the next save of ``nbytes`` (this rank's) reaches: True for tier 1
        (always without tier 0; with it every ``Tier0.tier1_every``-th save, the first
        included), False for tier 0 alone. Collective at the first save with tier 0:
        ``tier0_fits`` (the RAM budget) may turn tier 0 off, and every save then goes to
        tier 1. Call once per save, before :meth:`submit`."""
        if self.tier0 is None:
            return True
        if self._tier0_fits is not None and not self._tier0_fits(nbytes):
            self.tier0 = None
            return True
        self._routed += 1
        return (self._routed - 1) % self.tier0_config.tier1_every == 0

    def submit(self, job: SaveJob, handle: SaveHandle) -> None:
        def run() -> None:
            try:
                result = self._run(job)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                err = self._disk_full(job, e) or (e if isinstance(e, SaveError) else SaveError(
                    f"rank {self.comm.rank}: save of step {job.step} failed: "
                    f"{type(e).__name__}: {e}"))
                err.__cause__ = e if err is not e else e.__cause__
                self._plans.sent = b""  # the next save sends its write results whole
                self._frozen = None  # the next save writes its frozen file
                self.log.emit(events.SAVE_FAILED, step=job.step, error=str(err))
                self._discard(job)
                handle.durable.set_exception(err)
                return
            reclaim: list[Path] = []
            if self.is_owner and self.on_committed is not None and result.tier == "tier1":
                try:  # retention: old checkpoints leave their final names before we resolve
                    reclaim = self.on_committed(result)
                except Exception as e:  # never fail a committed save over retention
                    _log.warning("retention after step %d failed: %s", job.step, e)
            handle.durable.set_result(result)
            if self._pages is not None:
                self._pages.housekeep()
            for path in reclaim:  # freeing the space is housekeeping, after the handle
                try:
                    remove_tree(path)
                except OSError as e:
                    _log.warning("could not remove %s (start-up cleanup will): %s", path, e)
        self._pool.submit(run)

    def close(self, *, wait: bool = True) -> None:
        """Stop the worker; ``wait=False`` abandons a write that is stuck (it ends, or dies
        with the process) so that closing stays bounded. Then the kept mappings go (one a
        stuck write still copies into stays until that ends: it cannot be closed)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        if self._pages is not None:
            self._pages.mappings.close()

    def _discard(self, job: SaveJob) -> None:
        """After a failed save, the domain owner removes the save's tmp directory (other
        ranks' complete shards included) so failed saves do not fill the disk."""
        if not self.is_owner:
            return
        roots = [self.tier1] if self.tier0 is None else [self.tier0.path, self.tier1]
        for root in roots:
            tmp = root / layout.tmp_dirname(job.step, job.save_id)
            try:
                remove_tree(tmp)
            except FileNotFoundError:
                pass
            except OSError as e:
                _log.warning("could not remove %s (start-up cleanup will): %s", tmp, e)

    def _disk_full(self, job: SaveJob, e: BaseException) -> DiskFullError | None:
        """The one-line error of a save some rank could not write for lack of space."""
        tier, root = ("tier0", self.tier0.path) if self.tier0 is not None else \
            ("tier1", self.tier1)
        return disk_full(e, tier=tier, root=root, step=job.step, needed=job.nbytes,
                         rank=self.comm.rank)

    # -- the background job ---------------------------------------------------------------
    def _run(self, job: SaveJob) -> SaveResult:
        """Write, commit and (with tier 0) replicate and copy one save; collective."""
        staged_at = self._staging_done(job)
        in_ram = self.tier0 is not None
        root = self.tier0.path if self.tier0 is not None else self.tier1
        tmp = root / layout.tmp_dirname(job.step, job.save_id)
        final = root / layout.step_dirname(job.step)
        writer = self._writer(tmp, in_ram=in_ram, frozen=self._frozen_plan(job, in_ram))
        written = coordinate.save(job.staged, writer, self.comm, self._plans,
                                  self.committer.held_digest)
        durable_at = time.monotonic()
        my_bytes = sum(f.size for f in writer.files)
        shards = {f.name: f.size for f in writer.files if layout.shard_rank(f.name) is not None}
        if written.error is None:
            extra = {"kept": job.kept_bytes, "linked": writer.linked} if job.frozen else {}
            if in_ram:
                extra["mapped"] = writer.mapped_bytes
            self.log.emit(events.SAVE_DURABLE, step=job.step,
                          seconds=durable_at - staged_at, bytes=my_bytes,
                          tier="tier0" if in_ram else "tier1", **extra)
        done = self.committer.commit(job.step, job.save_id, writer, written, tmp, final)
        f = writer.frozen_file
        self._frozen = None if f is None or in_ram else dataclasses.replace(f, directory=final)
        tier = "tier1"
        if self.tier0 is not None and self._pages is not None:
            self._pages.after_write(shards, recycled=writer.recycled, final=final)
            final, tier = self._after_tier0(job, done.committed, final, my_bytes, staged_at)
            self._pages.mappings.prune()  # files retention deleted: their pages go back now
        now = time.monotonic()
        result = SaveResult(step=job.step, path=final, bytes_total=done.total,
                            seconds=now - job.started, write_seconds=now - staged_at,
                            manifest=done.manifest, tier=tier)
        self.log.emit(events.SAVE_COMMITTED, step=job.step, seconds=result.seconds,
                      write_seconds=result.write_seconds, bytes=result.bytes_total, tier=tier)
        return result

    @staticmethod
    def _staging_done(job: SaveJob) -> float:
        """When staging ended (monotonic): with ``staging="overlap"`` after waiting for the
        background copies, whose error fails the save."""
        if job.ready is None:
            return job.staged_at
        waited = not job.ready.done()
        job.ready.result()  # copies still running end before the next optimizer step
        return time.monotonic() if waited else job.staged_at

    def _frozen_plan(self, job: SaveJob, in_ram: bool) -> FrozenPlan | None:
        """``Writes(incremental=True)``: the frozen tensors in a file of their own, linked
        from the previous committed step when the stager kept every one (none changed, and
        not a full save: those copy them all) — on tier 1 only (with tier 0 it is written)."""
        if not (self.writes.incremental and job.frozen):
            return None
        previous = None if in_ram or self.tier0 is not None else self._frozen
        return FrozenPlan(keys=job.frozen, unchanged=job.kept == job.frozen,
                          previous=previous)

    def _writer(self, tmp: Path, *, in_ram: bool,
                frozen: FrozenPlan | None = None) -> ShardWriter:
        """The DCP writer into ``tmp`` (created; the ranks of one domain share it); in RAM
        (tier 0) without fsync or direct I/O."""
        w = self.writes
        tmp.mkdir(mode=w.dir_mode, exist_ok=True)
        free = self.tier0.free if in_ram and self.tier0 is not None else None
        return ShardWriter(tmp, thread_count=w.threads, file_mode=w.file_mode,
                           fsync=w.fsync and not in_ram, direct_io=w.direct_io and not in_ram,
                           recycle=free, io_threads=TIER0_IO_THREADS if in_ram else 1,
                           frozen=frozen,
                           mapped=self._pages.mappings if in_ram and self._pages else None)

    def _after_tier0(self, job: SaveJob, committed: mf.Committed | None, final: Path,
                     my_bytes: int, staged_at: float) -> tuple[Path, str]:
        """Collective, after a commit on tier 0: replicate it to a peer, copy it to tier 1
        when ``job.to_tier1``, and keep the newest on tier 0. Where the save now lives and
        which tier that is."""
        assert self.tier0 is not None
        self.log.emit(events.TIER0_SAVED, step=job.step, bytes=my_bytes,
                      seconds=time.monotonic() - staged_at)
        self._replicate(committed)
        tier = "tier1"
        if job.to_tier1:
            self.copy_to_tier1(committed, final)
            final = self.tier1 / layout.step_dirname(job.step)
        else:
            tier = "tier0"
        if self.is_owner:
            keep_newest(self.tier0.own, self.tier0_config.keep, free=self.tier0.free)
            keep_newest(self.tier0.peer, self.tier0_config.keep)
            self.tier0.touch()
        return final, tier

    def _replicate(self, committed: mf.Committed | None) -> None:
        """Owners: the ring exchange of tier-0 replicas. A failure is an event and a
        warning, never a failed save (tier 1 and tier 2 still hold the job)."""
        if committed is None or self.tier0 is None or not self.tier0_config.replicate \
                or len(self.domains) < 2 or not self.is_owner:
            return
        w, comm, step = self.writes, self.comm, committed.manifest.step
        t0 = time.monotonic()
        try:
            got = replicate(comm, self.domains, self.domain, self.tier0, committed,
                            file_mode=w.file_mode, dir_mode=w.dir_mode,
                            bandwidth=self.tier0_config.bandwidth)
        except Exception as e:
            self.log.emit(events.TIER0_REPLICATION_FAILED, step=step, error=str(e))
            _log.warning("tier-0 replica of step %d failed: %s", step, e)
            return
        self.log.emit(events.TIER0_REPLICATED, step=step, bytes=got,
                      seconds=time.monotonic() - t0)

    def flush_to_tier1(self, last: SaveResult) -> None:
        """Collective, at close: ``last`` lives in RAM only; copy it to tier 1 so the run's
        last state outlives the node (and reaches tier 2), then apply retention."""
        committed = read_committed(last.path, step=last.step) if self.is_owner else None
        self.copy_to_tier1(committed, last.path)
        self.log.emit(events.SAVE_COMMITTED, step=last.step, seconds=0.0, write_seconds=0.0,
                      bytes=last.bytes_total, tier="tier1", flushed=True)
        if self.is_owner and self.on_committed is not None:
            for p in self.on_committed(last):
                with contextlib.suppress(OSError):
                    remove_tree(p)

    def copy_to_tier1(self, committed: mf.Committed | None, src: Path) -> None:
        """Collective: owners copy the committed tier-0 step at ``src`` to tier 1
        (verified; ``committed`` is read by owners, None elsewhere); raises SaveError on
        every rank when one failed."""
        w, comm = self.writes, self.comm
        step = layout.parse_step_dirname(src.name)
        error = None
        if self.is_owner and committed is not None:
            try:
                copy_to_tier1(src, Tier1Catalog(self.tier1), committed, file_mode=w.file_mode,
                              dir_mode=w.dir_mode, fsync=w.fsync, direct_io=w.direct_io)
            except Exception as e:
                error = f"rank {comm.rank}: copy of step {step} to tier 1 failed: {e}"
        errors = [e for e in comm.all_gather(error) if e]
        if errors:
            raise SaveError("; ".join(errors) + " (the step stays in tier 0)")

