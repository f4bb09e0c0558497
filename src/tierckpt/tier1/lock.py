"""Exclusive ``flock`` locks on a tier-1 root: one job per root, one uploader per root.

``flock`` is released by the kernel when the holder dies, so a crashed job or uploader never
leaves a stale lock behind; a live second holder gets :class:`LockError` naming the first.
A file system without ``flock`` (Lustre without ``-o flock``, NFS mounted ``nolock``) also
gets :class:`LockError`, naming the root and the fix, never a raw ``OSError``: without the
lock two jobs could write one root.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from tierckpt.errors import LockError

UNSUPPORTED = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})
"""``flock`` errors that mean the file system cannot lock at all (not: someone holds it)."""


class FileLock:
    """An exclusive, non-blocking ``flock`` on ``path`` (created if missing), held until
    :meth:`release`. The holder's pid and host are written into the file, so the error a
    second holder gets can name the first. ``busy`` is the message of that error; ``{holder}``
    in it is replaced by what the file says. ``root`` (default: the file's directory) is the
    tier-1 root the lock guards, named when its file system cannot lock (:data:`UNSUPPORTED`)."""

    def __init__(self, path: Path, *, busy: str, file_mode: int = 0o640,
                 root: Path | None = None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
            os.close(self._fd)
            self._fd = -1
            raise LockError(busy.format(holder=holder or "unknown holder")) from None
        except OSError as e:
            os.close(self._fd)
            self._fd = -1
            if e.errno not in UNSUPPORTED:
                raise
            where = path.parent if root is None else root
            raise LockError(
                f"cannot lock {str(where)!r}: its file system does not support flock "
                f"({errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror or e}); mount it "
                "with flock support (Lustre: -o flock; NFS: without nolock) or put tier1 on "
                "a local disk") from e
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        """Release the lock. Idempotent."""
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
