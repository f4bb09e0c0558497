"""Durable file-system primitives: fsync'd writes, directory fsync, no-follow removal."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

DEFAULT_FILE_MODE = 0o640
DEFAULT_DIR_MODE = 0o750


def _libc_sync_file_range() -> Any:
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` of ``fd`` to the device now, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): bytes written in pieces
    (downloads) reach the disk while later pieces arrive, so the final fsync — which is
    still what makes them durable — has little left to do. The pages stay cached. A no-op
    where the call is missing or fails."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so the names created/renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | os.PathLike[str], data: bytes, *, mode: int = DEFAULT_FILE_MODE,
                  exclusive: bool = False) -> None:
    """Atomically create/replace ``path`` with ``data``: tmp file, fsync, rename, fsync dir.

    With ``exclusive=True`` an existing ``path`` is never replaced (FileExistsError), which
    is how ``COMPLETE`` is written: a marker is created once, never overwritten.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)  # fails with FileExistsError instead of replacing
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree without following symlinks (a link is unlinked, its target
    is left alone). A symlink given as ``path`` itself is unlinked, not followed."""
    p = Path(path)
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        os.unlink(p)
        return
    # shutil.rmtree uses fd-based, symlink-safe traversal on Linux (avoids_symlink_attacks).
    shutil.rmtree(p)


def move_aside(src: Path, dest_dir: Path, name: str) -> Path:
    """Rename ``src`` into ``dest_dir`` under a unique name derived from ``name``; fsync
    both parents. Returns the new path. Used for quarantine: nothing is deleted."""
    dest_dir.mkdir(mode=DEFAULT_DIR_MODE, exist_ok=True)
    dest = dest_dir / f"{name}.{uuid.uuid4().hex[:8]}"
    os.rename(src, dest)
    fsync_dir(src.parent)
    fsync_dir(dest_dir)
    return dest
