"""tier1.fs: durable writes and early writeback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierckpt.tier1 import fs


def test_start_writeback_is_wired_on_linux_and_leaves_the_bytes_alone(tmp_path: Path) -> None:
    # tierckpt's platform is Linux: without it downloads would silently lose the overlap
    assert fs._SYNC_FILE_RANGE is not None
    data = os.urandom(3 << 20)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, len(data))
        for off in range(0, len(data), 1 << 20):  # pieces written out of order, like ranges
            os.pwrite(fd, data[off:off + (1 << 20)], off)
            fs.start_writeback(fd, off, 1 << 20)
        fs.start_writeback(fd, 0, 0)  # 0 = to the end of the file
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data
    fs.start_writeback(-1, 0, 1)  # a bad descriptor is ignored, not raised


def test_write_durably_exclusive_never_replaces(tmp_path: Path) -> None:
    fs.write_durably(tmp_path / "m", b"one", exclusive=True)
    with pytest.raises(FileExistsError):
        fs.write_durably(tmp_path / "m", b"two", exclusive=True)
    assert (tmp_path / "m").read_bytes() == b"one"
