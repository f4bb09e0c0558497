"""Background writing and committing of staged state: exactly one save in flight.

``AsyncSaver.submit`` hands a staged state dict to a single worker thread that (1) writes
this rank's shard files into the save's tmp directory through DCP with :class:`ShardWriter`
(CRC32C on the same pass, fsync), (2) gathers every rank's file list to rank 0, which builds
the manifest and marker, (3) has each domain owner run :func:`commit.commit_domain`, and
(4) agrees with every rank on the outcome. All collectives use the manager's dedicated gloo
group with its own timeout, so a dead peer turns into an error, not a hang.

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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierckpt import __version__
from tierckpt.config import ManagerConfig
from tierckpt.errors import SaveError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm
from tierckpt.save.writer import ShardWriter
from tierckpt.tier1.commit import commit_domain
from tierckpt.tier1.fs import remove_tree

_log = logging.getLogger("tierckpt")


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
    manifest: mf.Manifest


@dataclasses.dataclass
class SaveHandle:
    """Returned by every ``save()``. ``staged`` resolves to the blocking seconds (C) before
    ``save()`` returns; ``durable`` to a :class:`SaveResult` once the checkpoint is committed
    on every rank (or to a :class:`SaveError`)."""

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


class AsyncSaver:
    """One worker thread; the caller guarantees one job at a time (the manager waits for the
    previous handle before submitting). ``on_committed(result)`` runs on the worker thread of
    domain owners after a successful commit (retention): it unpublishes what it drops and
    returns those directories, which are removed after the handle resolved. A failure there
    is logged, never turned into a failed save."""

    def __init__(self, cfg: ManagerConfig, comm: Comm, domains: tuple[tuple[int, ...], ...],
                 log: events.EventLog,
                 on_committed: Callable[[SaveResult], list[Path]] | None = None) -> None:
        self.cfg, self.comm, self.domains, self.log = cfg, comm, domains, log
        self.on_committed = on_committed
        self.is_owner = any(d[0] == comm.rank for d in domains)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-saver",
                                        initializer=_lower_thread_priority,
                                        initargs=(cfg.background_nice,))

    def submit(self, job: SaveJob, handle: SaveHandle) -> None:
        def run() -> None:
            try:
                result = self._run(job)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                err = e if isinstance(e, SaveError) else SaveError(
                    f"rank {self.comm.rank}: save of step {job.step} failed: "
                    f"{type(e).__name__}: {e}")
                err.__cause__ = e if err is not e else e.__cause__
                self.log.emit(events.SAVE_FAILED, step=job.step, error=str(err))
                self._discard(job)
                handle.durable.set_exception(err)
                return
            reclaim: list[Path] = []
            if self.is_owner and self.on_committed is not None:
                try:  # retention: old checkpoints leave their final names before we resolve
                    reclaim = self.on_committed(result)
                except Exception as e:  # never fail a committed save over retention
                    _log.warning("retention after step %d failed: %s", job.step, e)
            handle.durable.set_result(result)
            for path in reclaim:  # freeing the space is housekeeping, after the handle
                try:
                    remove_tree(path)
                except OSError as e:
                    _log.warning("could not remove %s (start-up cleanup will): %s", path, e)
        self._pool.submit(run)

    def close(self, *, wait: bool = True) -> None:
        """Stop the worker; ``wait=False`` abandons a write that is stuck (it ends, or dies
        with the process) so that closing stays bounded."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _discard(self, job: SaveJob) -> None:
        """After a failed save, the domain owner removes the save's tmp directory (other
        ranks' complete shards included) so failed saves do not fill the disk."""
        if not self.is_owner:
            return
        tmp = self.cfg.tier1 / layout.tmp_dirname(job.step, job.save_id)
        try:
            remove_tree(tmp)
        except FileNotFoundError:
            pass
        except OSError as e:
            _log.warning("could not remove %s (start-up cleanup will): %s", tmp, e)

    # -- the background job ---------------------------------------------------------------
    def _run(self, job: SaveJob) -> SaveResult:
        cfg, comm = self.cfg, self.comm
        tmp = cfg.tier1 / layout.tmp_dirname(job.step, job.save_id)
        final = cfg.tier1 / layout.step_dirname(job.step)
        tmp.mkdir(mode=cfg.dir_mode, exist_ok=True)  # ranks of one domain share it
        writer = ShardWriter(tmp, thread_count=cfg.write_threads, file_mode=cfg.file_mode,
                             fsync=cfg.fsync, direct_io=cfg.direct_io)
        dcp.save(job.staged, storage_writer=writer, process_group=comm.group,
                 no_dist=comm.group is None)
        durable_at = time.monotonic()
        my_bytes = sum(f.size for f in writer.files)
        self.log.emit(events.SAVE_DURABLE, step=job.step,
                      seconds=durable_at - job.staged_at, bytes=my_bytes)

        per_rank = comm.all_gather(writer.files)
        payload = None
        if comm.rank == 0:
            assert writer.metadata_entry is not None and writer.metadata_bytes is not None
            files = (*(f for fl in per_rank for f in fl), writer.metadata_entry)
            manifest = mf.Manifest(step=job.step, world_size=comm.world_size,
                                   save_id=job.save_id, files=files, domains=self.domains,
                                   created_unix=time.time(), torch_version=torch.__version__,
                                   tierckpt_version=__version__)
            mbytes = manifest.to_bytes()
            payload = (mbytes, mf.marker_bytes(mbytes, job.step, job.save_id, mf.signing_key()),
                       writer.metadata_bytes)
        mbytes, marker, meta_bytes = comm.broadcast(payload)

        error = None
        if self.is_owner:
            try:
                commit_domain(tmp, final, manifest_bytes=mbytes, marker_bytes=marker,
                              metadata_bytes=meta_bytes, file_mode=cfg.file_mode)
            except Exception as e:
                error = f"rank {comm.rank}: commit of step {job.step} in {cfg.tier1} failed: {e}"
        errors = [e for e in comm.all_gather(error) if e]
        if errors:
            raise SaveError("; ".join(errors))
        manifest = mf.Manifest.from_bytes(mbytes)
        now = time.monotonic()
        result = SaveResult(step=job.step, path=final, bytes_total=manifest.total_bytes,
                            seconds=now - job.started, write_seconds=now - job.staged_at,
                            manifest=manifest)
        self.log.emit(events.SAVE_COMMITTED, step=job.step, seconds=result.seconds,
                      write_seconds=result.write_seconds, bytes=result.bytes_total)
        return result
