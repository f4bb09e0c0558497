"""flock locks of a tier-1 root: a second holder is refused naming the first, and a file
system that cannot flock at all is a LockError naming the root and the fix."""

from __future__ import annotations

import errno
import fcntl
import os
import types
from pathlib import Path

import pytest

from tierckpt.errors import LockError
from tierckpt.tier1 import lock as lock_module
from tierckpt.tier1.catalog import Tier1Catalog


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _flock_failing_with(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Replace ``fcntl`` in the lock module's namespace only, by one whose ``flock`` fails
    with ``code`` as Lustre without ``-o flock`` (ENOSYS) or NFS mounted ``nolock``
    (ENOLCK) do."""
    def flock(fd: int, op: int) -> None:
        raise OSError(code, os.strerror(code))

    fake = types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB,
                                 LOCK_UN=fcntl.LOCK_UN)
    monkeypatch.setattr(lock_module, "fcntl", fake)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_unsupported_flock_is_a_lock_error_naming_the_root_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """A real file system without flock cannot be mounted on demand here, so ``flock`` is
    a fake that fails as one does; everything else (the open, the catalogue) is real."""
    _flock_failing_with(monkeypatch, code)
    before = _open_fds()
    cat = Tier1Catalog(tmp_path)
    for take in (cat.lock, cat.uploads.uploader_lock):
        with pytest.raises(LockError) as e:
            take()
        msg = str(e.value)
        assert repr(str(tmp_path)) in msg and "does not support flock" in msg
        assert errno.errorcode[code] in msg
        assert "mount it with flock support" in msg and "tier1 on a local disk" in msg
    assert _open_fds() == before  # the lock file's descriptor was closed


def test_other_flock_errors_are_not_disguised(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _flock_failing_with(monkeypatch, errno.EIO)
    with pytest.raises(OSError) as e:
        Tier1Catalog(tmp_path).lock()
    assert e.value.errno == errno.EIO and not isinstance(e.value, LockError)


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    cat = Tier1Catalog(tmp_path)
    first = cat.lock()
    try:
        with pytest.raises(LockError, match=f"pid={os.getpid()}"):
            cat.lock()
    finally:
        first.release()
    cat.lock().release()  # released: free again
