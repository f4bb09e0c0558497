"""Evicting files from the page cache and checking that it happened.

A cold read is only cold if the file's pages are gone. Eviction is tried in the least
disruptive order: ``posix_fadvise(DONTNEED)`` on the files themselves (after an fsync, since
dirty pages are not dropped), then ``echo 1 > /proc/sys/vm/drop_caches`` (root only, whole
machine). ``mincore(2)`` on a mapping of each file says how much is still resident, so the
result records which method worked instead of assuming it did.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_PAGE = mmap.PAGESIZE
_RESIDENT_OK = 0.05  # at most 5 % of pages may remain for the read to count as cold
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@dataclass(frozen=True)
class Eviction:
    """How the cache was dropped: method is ``fadvise``, ``drop_caches`` or ``none``."""

    method: str
    honoured: bool
    resident_before: float
    resident_after: float

    def to_json(self) -> dict[str, Any]:
        """Plain dict for the results file."""
        return asdict(self)


def resident_fraction(paths: Iterable[Path]) -> float:
    """Fraction (0..1) of the files' pages in the page cache, by ``mincore``; 0 for no bytes."""
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + _PAGE - 1) // _PAGE
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
            vec = (ctypes.c_ubyte * pages)()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
            resident += sum(b & 1 for b in bytes(vec))
            total += pages
    return resident / total if total else 0.0


def _fadvise_dontneed(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED skips dirty pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def files_under(root: Path) -> list[Path]:
    """Every regular file below ``root`` (or ``root`` itself when it is a file)."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def evict(paths: list[Path]) -> Eviction:
    """Drop ``paths`` from the page cache, trying fadvise, then drop_caches; say what worked."""
    before = resident_fraction(paths)
    _fadvise_dontneed(paths)
    after = resident_fraction(paths)
    if after <= _RESIDENT_OK:
        return Eviction("fadvise", True, before, after)
    if _drop_caches():
        after = resident_fraction(paths)
        if after <= _RESIDENT_OK:
            return Eviction("drop_caches", True, before, after)
    return Eviction("none", False, before, after)
