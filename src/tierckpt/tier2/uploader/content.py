"""Sending one root's files to content-addressed tier 2: each object once, ever.

:func:`upload_step` (``transfer.py``) calls these in order, per root (one node's files):

1. :func:`hash_files` — the SHA-256 of each own file, one read each (``hashlib`` releases
   the GIL; the saver does not record it yet, so the uploader computes it) — except a file
   this process already hashed: the same inode, size, mtime and manifest CRC32C (a frozen
   file that incremental saves hard-link into every step is read once, not per step);
2. the root's map part is written (its intent, before any skip decision);
3. :func:`send` — per distinct object: HEAD its key; an object of the manifest's size and
   CRC32C is there → skipped (frozen weights, unchanged buffers, a step fetched back and
   uploaded again); else PUT with the manifest's CRC32C, which the store checks end to end;
4. :func:`recheck` — after the catalogue saw no sweep still deleting
   (:meth:`~tierckpt.tier2.catalog.Tier2Catalog.await_sweeps`), HEAD every object again
   and PUT the ones a concurrent sweep removed (tier 1 is pinned, so the bytes are there).

The skip trusts what the store reports (size and full-object CRC32C), as the resume of an
interrupted upload always did; an object whose CRC32C the store does not report is sent
again, and then refused as before (the uploader verifies every object by that report). A
damaged object whose metadata still matches is caught on every read, which checks the bytes
against the manifest's CRC32C.

Granularity: a *file* is the unit. DCP writes one shard file per rank holding all of its
tensors, so a frozen tensor saves upload only when it sits in a file whose bytes did not
change: ``Writes(incremental=True)`` writes each rank's frozen parameters to a file of their
own (docs/staging.md).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from pathlib import Path

from tierckpt.errors import IntegrityError, UploadStopped
from tierckpt.format import manifest as mf
from tierckpt.format import objmap
from tierckpt.tier2.storage import ObjectInfo, Storage
from tierckpt.tier2.storage.base import Progress

CHUNK = 8 << 20
_HASHED: dict[tuple[int, ...], str] = {}
"""(device, inode, size, mtime, manifest CRC32C) → SHA-256 of files this process hashed."""
_HASHED_MAX = 4096


def _stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise UploadStopped


def sha256_of(path: Path, stop: threading.Event | None = None) -> str:
    """SHA-256 hex digest of the file at ``path`` (one sequential read)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            _stop(stop)
    return h.hexdigest()


def hash_files(ckpt: Path, own: Iterable[mf.FileEntry],
               stop: threading.Event | None = None) -> list[objmap.MapEntry]:
    """Map entries of ``own`` files of the tier-1 directory ``ckpt``. A file whose inode,
    size and mtime this process hashed before, under the same manifest CRC32C, is not read
    again (a hard link shares the inode; a write in place moves the mtime; bytes damaged
    at rest would still fail the store's CRC32C check when sent)."""
    return [objmap.MapEntry(name=f.name, size=f.size, crc32c=f.crc32c,
                            sha256=_sha256_once(ckpt / f.name, f.crc32c, stop)) for f in own]


def _sha256_once(path: Path, crc32c: int, stop: threading.Event | None) -> str:
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, crc32c)
    digest = _HASHED.get(key)
    if digest is None:
        digest = sha256_of(path, stop)
        if len(_HASHED) >= _HASHED_MAX:
            _HASHED.pop(next(iter(_HASHED)))
        _HASHED[key] = digest
    return digest


def part_tag(own: Iterable[mf.FileEntry]) -> str:
    """This root's part name tag: its lowest rank (``r00003``), ``shared`` when it holds
    only the coordinator's files."""
    ranks = [f.rank for f in own if f.rank is not None]
    return f"r{min(ranks):05d}" if ranks else "shared"


def matches(info: ObjectInfo | None, e: objmap.MapEntry | mf.FileEntry) -> bool:
    """Whether the store reports exactly the size and CRC32C the manifest records."""
    return info is not None and info.size == e.size and info.crc32c == e.crc32c


def _distinct(entries: Iterable[objmap.MapEntry]) -> list[objmap.MapEntry]:
    seen: dict[str, objmap.MapEntry] = {}
    for e in entries:
        seen.setdefault(e.key, e)
    return list(seen.values())


def send(st: Storage, ckpt: Path, entries: list[objmap.MapEntry], *,
         stop: threading.Event | None, progress: Progress | None
         ) -> tuple[int, list[objmap.MapEntry]]:
    """Upload each distinct object of ``entries`` that tier 2 lacks; returns ``(bytes
    sent, entries skipped because their object was there)``."""
    total = sum(e.size for e in entries)
    sent = done = 0
    skipped = []
    for e in _distinct(entries):
        _stop(stop)
        if matches(st.head(e.key), e):
            skipped.append(e)
        else:
            st.put_file(e.key, ckpt / e.name, crc32c=e.crc32c, size=e.size)
            sent += e.size
        done += e.size
        if progress is not None:
            progress(done, total)
    return sent, skipped


def recheck(st: Storage, ckpt: Path, entries: list[objmap.MapEntry], step: int) -> int:
    """HEAD each distinct object of ``entries``; PUT again the ones that went missing (a
    sweep that started before this root's part was written) and return their bytes.
    Raises :class:`IntegrityError` when the store still does not report one."""
    sent = 0
    for e in _distinct(entries):
        if not matches(st.head(e.key), e):
            st.put_file(e.key, ckpt / e.name, crc32c=e.crc32c, size=e.size)
            sent += e.size
            if not matches(st.head(e.key), e):
                raise IntegrityError(f"step {step}: tier 2 does not report what was "
                                     f"uploaded for {e.name}")
    return sent
