"""ENOSPC found wherever a failed save carries it, and told as one DiskFullError; values
only (a real full file system is tests/faults/test_fault_disk_errors.py)."""

from __future__ import annotations

import errno
from pathlib import Path

from tierckpt.errors import SaveError
from tierckpt.save.diskfull import disk_full, is_enospc


class _CheckpointException(BaseException):
    """DCP's shape: per-rank failures in a dict, a BaseException."""

    def __init__(self, msg: str, failures: dict[int, BaseException]) -> None:
        super().__init__(msg)
        self.failures = failures


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def test_enospc_itself_its_cause_and_a_ranks_failure() -> None:
    assert is_enospc(_enospc())
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = _enospc()
    assert is_enospc(wrapped)
    assert is_enospc(_CheckpointException("dcp", {1: _enospc()}))


def test_a_remote_ranks_enospc_as_text() -> None:
    assert is_enospc(SaveError("rank 1: [Errno 28] No space left on device"))
    assert is_enospc(_CheckpointException("rank 3: No space left on device", {}))


def test_other_failures_are_not_enospc() -> None:
    assert not is_enospc(OSError(errno.EIO, "I/O error"))
    assert not is_enospc(SaveError("rank 1: commit failed"))
    assert not is_enospc(RuntimeError("No space left on device"))  # text counts on saves only


def test_disk_full_names_the_tier_the_space_and_the_need(tmp_path: Path) -> None:
    err = disk_full(_enospc(), tier="tier1", root=tmp_path, step=7, needed=3 << 20, rank=2)
    assert err is not None
    assert str(err).startswith(f"tier1 is full: {tmp_path} has ")
    assert "the save of step 7 needs about" in str(err) and "on rank 2" in str(err)
    assert (err.tier, err.path, err.needed) == ("tier1", str(tmp_path), 3 << 20)
    assert disk_full(RuntimeError("x"), tier="tier1", root=tmp_path, step=7, needed=1,
                     rank=0) is None
