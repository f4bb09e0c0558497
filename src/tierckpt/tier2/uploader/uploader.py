""":class:`Uploader`: one tier-1 root's uploader in-process — the lock, the clients and the
composition of policy (what is due), transfer (moving bytes) and the loop (when)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from tierckpt.format import layout
from tierckpt.policy import retention
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.uploads import UPLOAD_DUE, UPLOAD_HOLDER, UPLOAD_REQUEST
from tierckpt.tier2 import probe
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import Storage, open_storage
from tierckpt.tier2.storage.url import OBJECT_STORES, parse_url
from tierckpt.tier2.uploader import transfer, watch
from tierckpt.tier2.uploader.config import UploaderConfig, UploadResult


class Uploader:
    """Uploads committed tier-1 checkpoints per :class:`UploaderConfig`. Context manager.

    Holds ``<tier1>/upload-state/.lock`` (flock) while open, so a second uploader on the
    same root fails with :class:`~tierckpt.errors.LockError`. On open it removes its own
    stale pins (left by a killed predecessor).
    """

    def __init__(self, config: UploaderConfig, *, storage: Storage | None = None,
                 progress: transfer.Progress | None = None) -> None:
        self.config = config
        self.local = Tier1Catalog(config.tier1)
        self._progress = progress
        self._closed = False
        self._aligned: threading.Event | None = None  # set by watch(): see _committed_by_epoch
        self._lock = self.local.uploads.uploader_lock()
        try:
            self.storage = storage if storage is not None else open_storage(
                config.tier2, **self._options())
            self.remote = Tier2Catalog(self.storage)
            self.log = events.EventLog(Path(config.tier1) / layout.EVENTS)
        except BaseException:
            self._lock.release()
            raise
        self.local.unpin_all(UPLOAD_HOLDER)

    def _options(self) -> dict[str, Any]:
        """The options to open tier 2 with: the caller's, plus — for any object store,
        unless the caller chose the integrity mode — the modes of the job's probe of this
        server that its config takes (cached on tier 1; probed now if absent), after
        checking the server is usable."""
        opts = dict(self.config.storage_options)
        if parse_url(self.config.tier2).scheme in OBJECT_STORES and "integrity" not in opts:
            result = probe.probe_cached(self.local, self.config.tier2, **opts)
            probe.require_usable(result)
            opts = {**result.store_options(), **opts}
        return opts

    def close(self) -> None:
        """Release the storage client, event log and lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.storage.close()
        self.log.close()
        self._lock.release()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_step(self) -> int | None:
        """The step to upload next (see :func:`tierckpt.policy.retention.next_upload`)."""
        if self.config.count_commits:
            counted = self.local.uploads.upload_cadence()
            for step in sorted(self.local.complete_steps()):
                if counted is None or step > counted[1]:
                    self.local.uploads.count_commit(step, upload_every=self.config.upload_every)
        complete = self.local.complete_steps()
        requested = self.local.uploads.upload_requests()
        if self._aligned is not None and not self._aligned.is_set():
            complete = self._committed_by_epoch(complete, requested)
        return retention.next_upload(complete, upload_every=self.config.upload_every,
                                     done=self.local.uploads.uploaded_steps(), requested=requested,
                                     marked=self.local.uploads.upload_marks())

    def _committed_by_epoch(self, complete: list[int], requested: set[int]) -> list[int]:
        """While watching: the steps committed here before the start of the current epoch
        (wall-clock multiples of ``poll_s``), and every requested one. Each node's uploader
        then chooses the same newest step whenever it chooses within an epoch — not the
        newest at its own moment, which differs between nodes when saves come faster than
        uploads, so that each would upload its part of another step and none would ever
        complete on tier 2. A step committed near an epoch's start may fall on either side
        on different nodes (clock skew, each node's marker time): those two disagree for
        that epoch only."""
        epoch = time.time() // self.config.poll_s * self.config.poll_s
        out = []
        for step in complete:
            try:
                t = os.stat(self.local.step_dir(step) / layout.COMPLETE).st_mtime
            except OSError:
                continue
            if t < epoch or step in requested:
                out.append(step)
        return out

    def upload_step(self, step: int, *, stop: threading.Event | None = None) -> UploadResult:
        """Copy ``step`` to tier 2 (:func:`tierckpt.tier2.uploader.transfer.upload_step`);
        once this call wrote its marker, apply tier-2 retention and drop the job's asks
        (marks, requests) of this step and every older one."""
        result = transfer.upload_step(self.local, self.remote, step, log=self.log,
                                      progress=self._progress, stop=stop,
                                      committed=self.apply_retention)
        uploads = self.local.uploads
        if step in uploads.uploaded_steps():  # older asks are abandoned: a newer copy is up
            for asked in uploads.upload_requests() | uploads.upload_marks():
                if asked <= step:
                    self.local.unpin(asked, UPLOAD_REQUEST)
                    self.local.unpin(asked, UPLOAD_DUE)
        return result

    def run_once(self, stop: threading.Event | None = None) -> UploadResult | None:
        """Upload the next due step, if any; return its result (None when idle)."""
        step = self.next_step()
        return None if step is None else self.upload_step(step, stop=stop)

    def drain(self) -> list[UploadResult]:
        """Upload until nothing is due or an upload does not finish; return the results."""
        results: list[UploadResult] = []
        watch.run(self, threading.Event(), poll_s=self.config.poll_s, watch=False,
                  finished=results.append)
        return results

    def watch(self, stop: threading.Event, finish: threading.Event | None = None) -> bool:
        """Upload due steps until ``stop`` is set (see :func:`tierckpt.tier2.uploader.watch.run`);
        once ``finish`` is set, return as soon as nothing is due (True) or an upload fails
        (False). Choices are aligned across nodes (:meth:`_committed_by_epoch`) until
        ``finish`` is set."""
        self._aligned = finish if finish is not None else threading.Event()
        return watch.run(self, stop, poll_s=self.config.poll_s, watch=True, finish=finish)

    def apply_retention(self) -> list[int]:
        """Delete tier-2 checkpoints the tier-2 policy no longer keeps; return their steps."""
        return self.remote.apply_retention(keep_last=self.config.keep_last,
                                           keep_every=self.config.keep_every)
