"""Tier 0 keeps its shard files mapped: a save into RAM copies into pages already mapped.

A write into a tmpfs file through ``pwrite`` pays the kernel's bookkeeping for every 4 KiB
page (find the page, lock it, copy, mark it dirty): about twice a memcpy per byte here,
even into pages the file already owns (:mod:`tierckpt.tier0.recycle`). Mapping a file
costs about as much per page, once; a copy into pages mapped before is a memcpy. So each
rank keeps its own tier-0 shard files mapped (``MAP_SHARED``, populated once) from the save
that wrote them (or the reservation that allocated them) until their inode is gone, and a
save that takes one of them from ``free/`` copies into the mapping instead of writing
(:class:`~tierckpt.tier1.directio.DirectFile` with ``mapping=``).

Contract: a mapping is found only by the inode of the file at a path the caller names —
the file it took for its own save (link count 1: no committed step shares it) — so a copy
through it changes that file and nothing else. A file that shrank since it was mapped is written
through the mapping only up to its current size (never past its end). A mapping whose
file was deleted is dropped at the next :meth:`KeptMappings.prune` (the saver prunes after
every tier-0 save's retention, so deleted pages are not held beyond that), and
:meth:`KeptMappings.close` drops them all. A forked child (a data loader's worker) does not
inherit the mappings. The rank's resident size counts the mapped pages (``RssShmem``): they
are the tier-0 files' own, counted once on the node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from tierckpt.format import layout
from tierckpt.tier0.recycle import reserve

_log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: map every page of a range writable now, not at its first touch."""
MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
"""A child made by ``fork`` does not get the range."""


@dataclasses.dataclass
class _Mapped:
    fd: int
    mapping: mmap.mmap


class KeptMappings:
    """One rank's mapped tier-0 shard files, by inode. Thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], _Mapped] = {}
        self._lock = threading.Lock()

    def adopt(self, paths: Iterable[Path]) -> int:
        """Map each file of ``paths`` (populated, so the next copy into it faults nothing),
        replacing an older mapping of the same inode of another size. Files that are gone
        or empty are skipped; a file that cannot be mapped is left to ``pwrite``. Returns
        the bytes newly mapped."""
        done = 0
        for path in paths:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                with self._lock:
                    old = self._maps.get(key)
                if st.st_size == 0 or (old is not None and len(old.mapping) == st.st_size):
                    os.close(fd)
                    continue
                m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError):
                os.close(fd)
                continue
            with contextlib.suppress(OSError):  # a forked child (a data loader worker)
                m.madvise(MADV_DONTFORK)  # must not hold the pages of deleted files
            with contextlib.suppress(OSError):  # older kernels: pages map at first touch
                m.madvise(MADV_POPULATE_WRITE)
            with self._lock:
                old = self._maps.pop(key, None)
                self._maps[key] = _Mapped(fd, m)
            if old is not None:
                _close(old)
            done += st.st_size
        return done

    def lookup(self, path: Path) -> mmap.mmap | None:
        """The mapping of the file at ``path`` (the same inode), or None."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        with self._lock:
            got = self._maps.get((st.st_dev, st.st_ino))
        return None if got is None else got.mapping

    def prune(self) -> int:
        """Drop the mappings whose files were deleted (their pages go back); how many."""
        with self._lock:
            gone = [k for k, m in self._maps.items() if _deleted(m.fd)]
            dropped = [self._maps.pop(k) for k in gone]
        for m in dropped:
            _close(m)
        return len(dropped)

    def close(self) -> None:
        """Drop every mapping. Idempotent."""
        with self._lock:
            dropped, self._maps = list(self._maps.values()), {}
        for m in dropped:
            _close(m)

    @property
    def nbytes(self) -> int:
        """Bytes mapped."""
        with self._lock:
            return sum(len(m.mapping) for m in self._maps.values())


def _deleted(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def _close(m: _Mapped) -> None:
    with contextlib.suppress(BufferError, ValueError):  # a view still open: GC frees it
        m.mapping.close()
    with contextlib.suppress(OSError):
        os.close(m.fd)


class RamPages:
    """One rank's tier-0 pages between saves: after a tier-0 save (:meth:`after_write`),
    once its handle resolved (:meth:`housekeep`, on the saver's thread), the next save's
    pages are allocated when this one had to allocate its shard files (the first save, or a
    new layout: :func:`tierckpt.tier0.recycle.reserve` into ``free``), and the files it
    wrote and those waiting in ``free`` are mapped (:attr:`mappings`), so that a later save
    that takes them copies instead of writing."""

    def __init__(self, free: Path, *, file_mode: int) -> None:
        self.free, self.file_mode = free, file_mode
        self.mappings = KeptMappings()
        self._unreserved: dict[str, int] = {}
        self._to_map: list[Path] = []

    def after_write(self, shards: dict[str, int], *, recycled: int, final: Path) -> None:
        """A tier-0 save wrote ``shards`` (name -> bytes), ``recycled`` of them rewritten
        from ``free``, into the step committed at ``final``."""
        if recycled < len(shards):
            self._unreserved = shards
        self._to_map = [final / name for name in shards]

    def housekeep(self) -> None:
        """Reserve and map what the last tier-0 save left (each at most once)."""
        shards, self._unreserved = self._unreserved, {}
        paths, self._to_map = self._to_map, []
        t0 = time.monotonic()
        if shards:
            got = reserve(self.free, shards, file_mode=self.file_mode)
            _log.debug("tier 0: reserved %d bytes for the next save in %.3f s", got,
                       time.monotonic() - t0)
        if paths:
            got = self.mappings.adopt(
                [*paths, *(self.free / layout.safe_member_name(p.name) for p in paths)])
            _log.debug("tier 0: mapped %d bytes for later saves in %.3f s", got,
                       time.monotonic() - t0)
