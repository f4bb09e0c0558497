"""Moving the bytes of one committed tier-1 checkpoint to tier 2, verified, marker last.

Tier 2 is content-addressed (layout 2, :mod:`tierckpt.format.objmap`): each file's bytes
are the object ``objects/sha256/<hex>``, uploaded once whatever number of steps hold them.
Per checkpoint, in this order (:func:`upload_step`; the object steps are in
:mod:`tierckpt.tier2.uploader.content`):

1. pin it on tier 1 (``pins/step-XXXXXXXX.upload``) so retention keeps it;
2. verify its marker against its manifest; stop if tier 2 already has a marker (the same
   bytes: done; different bytes: a conflict, nothing is touched);
3. hash each file of the manifest that this root holds (SHA-256) and write this root's map
   part ``step-XXXXXXXX/objects.<tag>.json`` — the intent that keeps a concurrent sweep off
   the objects it is about to rely on;
4. abort this root's stale multipart uploads of its objects (a no-op in upload mode
   ``single-put``), then per distinct object: skip it when tier 2 reports the manifest's
   size and CRC32C for it, else upload it with the manifest's CRC32C as the object's
   full-object checksum (end to end: the server checks the bytes computed at write time);
5. when anything was skipped, wait until no sweep may still be deleting, then HEAD every
   own object again and upload what went missing;
6. when this root holds every file, its part (with the bytes sent) is the map; else rewrite
   the part with the bytes sent and merge every root's part: if another node's files are
   not all there yet, record ``files_verified`` and stop (that node's uploader commits when
   it finishes);
7. upload the map ``objects.json``, then ``manifest.json``, verify it, then ``COMPLETE``
   last with a create-only write, then drop the parts;
8. record ``verified``, run the caller's ``committed`` hook (tier-2 retention), unpin.

A crash at any point leaves no marker over unverified objects; a restart redoes the step
and sends only what is missing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from tierckpt.errors import CheckpointError, IntegrityError, UploadStopped
from tierckpt.format import layout, objmap
from tierckpt.format import manifest as mf
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.uploads import UPLOAD_HOLDER
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import ObjectExistsError, Storage
from tierckpt.tier2.storage.base import Progress, ThrottleCounter
from tierckpt.tier2.uploader import content
from tierckpt.tier2.uploader.config import UploadResult


def upload_step(local: Tier1Catalog, remote: Tier2Catalog, step: int, *,
                log: events.EventLog, progress: Progress | None = None,
                stop: threading.Event | None = None,
                committed: Callable[[], object] | None = None) -> UploadResult:
    """Copy the committed checkpoint of ``step`` to tier 2 (module docstring order).
    ``committed`` runs once this call wrote and verified the marker (e.g. tier-2
    retention), before the step is unpinned. The one ``upload_verified`` or
    ``upload_failed`` event of the call comes last and carries what the store's throttling
    cost it (``throttled_requests``, ``throttled_s``). Failures are recorded (status ``failed``,
    event ``upload_failed``) and returned, not raised: the caller retries on its next pass."""
    local.pin(step, UPLOAD_HOLDER)
    t0, since = time.monotonic(), throttling(remote.storage)
    try:
        upload = _StepUpload(local, remote, step, log, committed, t0=t0, since=since)
        return upload.run(progress, stop)
    except UploadStopped:
        return UploadResult(step, "stopped", seconds=time.monotonic() - t0)
    except (CheckpointError, OSError) as e:
        err = f"{type(e).__name__}: {e}"
        local.uploads.write_upload_record(step, status="failed", error=err,
                                          tier2=remote.storage.url)
        log.emit(events.UPLOAD_FAILED, step=step, error=err, source="uploader",
                 **throttled_since(remote.storage, since))
        return UploadResult(step, "failed", seconds=time.monotonic() - t0, error=err)
    finally:
        local.unpin(step, UPLOAD_HOLDER)


def throttling(storage: Storage) -> tuple[int, float]:
    """``storage``'s throttling so far (refused requests, seconds waited); zeros for a
    store that never throttles (see :class:`~tierckpt.tier2.storage.base.ThrottleCounter`)."""
    counter = getattr(storage, "throttled", None)
    return counter.snapshot() if isinstance(counter, ThrottleCounter) else (0, 0.0)


def throttled_since(storage: Storage, since: tuple[int, float]) -> dict[str, Any]:
    """The record and event fields for the throttling since ``since``: ``throttled_requests``
    and ``throttled_s`` (empty when there was none)."""
    requests, seconds = throttling(storage)
    if requests == since[0]:
        return {}
    return {"throttled_requests": requests - since[0],
            "throttled_s": round(seconds - since[1], 3)}


class _StepUpload:
    """One pinned step's upload; raises on failure (see :func:`upload_step`). ``t0`` and
    ``since``: the call's start (monotonic seconds) and :func:`throttling` then."""

    def __init__(self, local: Tier1Catalog, remote: Tier2Catalog, step: int,
                 log: events.EventLog, committed: Callable[[], object] | None, *,
                 t0: float, since: tuple[int, float]) -> None:
        self.local, self.remote, self.step, self.log = local, remote, step, log
        self.committed, self.t0, self.since = committed, t0, since
        self.ckpt = local.step_dir(step)
        self.base: dict[str, Any] = {"tier2": remote.storage.url,
                                     "integrity": remote.storage.integrity}
        self.referenced = 0
        """Bytes of the step's files this root uploads (sent, or already on tier 2)."""

    def key(self, name: str) -> str:
        return self.remote.key(self.step, name)

    def run(self, progress: Progress | None, stop: threading.Event | None) -> UploadResult:
        step, st = self.step, self.remote.storage
        try:
            m, manifest_bytes, marker = self.local.read_committed(step)
        except IntegrityError:
            if not self.ckpt.exists():
                return UploadResult(step, "gone")  # deleted before the pin took hold
            raise
        self.base["save_id"] = m.save_id
        remote_marker = self.remote.marker(step)
        if remote_marker is not None:
            return self._already_there(remote_marker == marker)

        own = self._own_files(m)
        total = self.referenced = sum(f.size for f in own)
        self.local.uploads.write_upload_record(step, status="uploading", bytes=total, **self.base)
        self.log.emit(events.UPLOAD_STARTED, step=step, bytes=total, source="uploader")
        entries = content.hash_files(self.ckpt, own, stop)
        part = objmap.ObjectMap(step=step, manifest_sha256=mf.digest(manifest_bytes),
                                entries=tuple(entries))
        tag = content.part_tag(own)
        self.remote.write_part(step, part, tag)
        ranked = {f.name for f in own if f.rank is not None}
        for e in entries:
            if e.name in ranked:  # shared files may be in flight from another node
                st.abort_uploads(e.key)
        sent, skipped = content.send(st, self.ckpt, entries, stop=stop, progress=progress)
        if skipped:
            self.remote.await_sweeps()
        sent += content.recheck(st, self.ckpt, entries, step)
        part = dataclasses.replace(part, uploaded=sent)
        if len(entries) == len(m.files):  # one root holds it all: its part is the map
            merged: objmap.ObjectMap | None = part
        else:
            self.remote.write_part(step, part, tag)
            merged = self._merged(m, manifest_bytes, {e.name for e in entries})
        if merged is None:  # other nodes' files: the last node to finish writes the marker
            return self._record("files_verified", sent)
        st.put_bytes(self.key(objmap.MAP), merged.to_bytes(mf.signing_key()))
        return self._commit(manifest_bytes, marker, sent,
                            tags=[tag] if merged is part else None)

    def _merged(self, m: mf.Manifest, manifest_bytes: bytes,
                own: set[str]) -> objmap.ObjectMap | None:
        """Every root's parts as one map, or None while another node's files are missing.
        A part of another checkpoint of this step (a save rolled back by a heal or restart
        after a node uploaded its part, then saved again) is not this one's: left out here,
        overwritten by its root's new part, and dropped with the others at the marker."""
        digest = mf.digest(manifest_bytes)
        merged = objmap.merge(p for p in self.remote.parts(self.step)
                              if p.manifest_sha256 == digest)
        merged.check(m, manifest_bytes, complete=False)
        if len(merged.entries) != len(m.files):
            return None
        others = {e.key: e for e in merged.entries if e.name not in own}
        if any(not content.matches(self.remote.storage.head(k), e) for k, e in others.items()):
            return None
        return merged

    def _own_files(self, m: mf.Manifest) -> list[mf.FileEntry]:
        """The manifest's files this root holds, each of the manifest's size."""
        own = [f for f in m.files if (self.ckpt / f.name).exists()]
        for f in own:
            if (size := (self.ckpt / f.name).stat().st_size) != f.size:
                raise IntegrityError(f"tier-1 {self.ckpt.name}/{f.name} has {size} bytes, "
                                     f"manifest says {f.size}; not uploading a damaged "
                                     "checkpoint")
        return own

    def _commit(self, manifest_bytes: bytes, marker: bytes, sent: int,
                tags: list[str] | None) -> UploadResult:
        """Steps 7 and 8: manifest, verified; the marker, create-only, read back; the map
        parts dropped (``tags``: only these, else every part listed)."""
        st, step = self.remote.storage, self.step
        info = st.put_bytes(self.key(layout.MANIFEST), manifest_bytes)
        if st.head(self.key(layout.MANIFEST)) != info:
            raise IntegrityError(f"step {step}: manifest.json on tier 2 does not verify")
        try:
            st.put_bytes(self.key(layout.COMPLETE), marker, if_none_match=True)
        except ObjectExistsError:
            return self._already_there(False)
        if st.get_bytes(self.key(layout.COMPLETE)) != marker:
            raise IntegrityError(f"step {step}: COMPLETE on tier 2 does not read back")
        self.remote.drop_parts(step, tags)  # the marker and objects.json protect them now
        r = self._record("verified", sent)
        if self.committed is not None:
            self.committed()
        self.log.emit(events.UPLOAD_VERIFIED, step=step, bytes=sent, seconds=r.seconds,
                      referenced=self.referenced, source="uploader",
                      **throttled_since(st, self.since))
        return r

    def _record(self, status: str, sent: int) -> UploadResult:
        seconds = time.monotonic() - self.t0
        self.local.uploads.write_upload_record(self.step, status=status, bytes=sent,
                                               seconds=seconds, **self.base)
        return UploadResult(self.step, status, sent, seconds)

    def _already_there(self, same: bool) -> UploadResult:
        if same:
            return self._record("verified", 0)
        err = "tier 2 already holds a different checkpoint for this step; left untouched"
        self.local.uploads.write_upload_record(self.step, status="conflict", error=err, **self.base)
        self.log.emit(events.UPLOAD_FAILED, step=self.step, error=err, source="uploader")
        return UploadResult(self.step, "conflict", 0, time.monotonic() - self.t0, err)
