"""Reading one object in parallel byte ranges: into a local file, verified, or into memory.

What the ranged backends (S3, GCS, Azure) share around their store-specific read of one
range: the split into ranges of ``part`` bytes, run on the backend's bounded pool
(:func:`~tierckpt.tier2.storage.pool.run_bounded`); the CRC32C of each range, taken as its
bytes arrive and combined into the file's; and the temporary file that becomes the
destination only once that CRC32C matches (:func:`get_file_verified`, the body of every
ranged backend's ``get_file``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from tierckpt.errors import BadDigestError, StorageError
from tierckpt.format import checksum
from tierckpt.tier1.fs import fsync_dir, start_writeback
from tierckpt.tier2.storage.base import TMP_MARK

__all__ = ["Range", "RangeReader", "Sink", "get_file_verified", "range_into_file",
           "read_ranges", "split"]

Range = tuple[int, int]
"""``(offset, length)`` of a byte range of an object."""
Sink = Callable[[int, bytes], None]
"""``sink(position, data)``: where a streamed read hands each piece as it arrives
(``position`` in the object). A range asked again after its body broke off starts over
at its offset."""
RangeReader = Callable[[int, int, Sink], None]
"""``read(offset, length, sink)``: a backend's streamed read of one range, retried inside,
pinned to one version of the object where the caller asked for that."""
Pool = Callable[[list[Range], Callable[[Range], int]], list[int]]
"""``parallel(ranges, fn)``: the backend's bounded pool, results in the order of ranges."""


def split(offset: int, length: int, part: int) -> list[Range]:
    """[offset, offset+length) as consecutive ranges of ``part`` bytes (the last shorter)."""
    return [(offset + o, min(part, length - o)) for o in range(0, length, part)]


def get_file_verified(where: str, path: str | os.PathLike[str], *, size: int,
                      want: int | None, part: int, attempts: int,
                      range_into: Callable[[int, Range], int], parallel: Pool) -> int:
    """A ranged backend's ``get_file`` once it has looked the object up: its ``size``
    bytes into ``path`` in ranges of ``part`` bytes, verified; returns their CRC32C.

    ``range_into(fd, (offset, length))`` is the store's part: it writes that range into
    ``fd`` at the same offsets and returns the CRC32C of those bytes, taken as they
    arrived, from the version the caller looked up. The bytes go to a temporary name
    beside ``path`` (:data:`~tierckpt.tier2.storage.base.TMP_MARK`), fsync'd, renamed to
    ``path`` only when the ranges' combined CRC32C equals ``want`` (None: nothing to check
    against) and the directory fsync'd; else the whole download is repeated, up to
    ``attempts`` times, then :class:`BadDigestError`. A local write failure is a
    :class:`StorageError`. ``where`` (``get <url>/<key>``) starts every message."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{TMP_MARK}{uuid.uuid4().hex}.{dest.name}")
    ranges = split(0, size, part)
    try:
        for _attempt in range(attempts):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
            try:
                os.ftruncate(fd, size)
                crcs = parallel(ranges, functools.partial(range_into, fd))
                os.fsync(fd)
            finally:
                os.close(fd)
            got = 0  # the file's CRC32C from the ranges' (taken as they arrived)
            for (_, length), crc in zip(ranges, crcs, strict=True):
                got = checksum.combine(got, crc, length)
            if want is None or got == want:
                os.replace(tmp, dest)
                fsync_dir(dest.parent)
                return got
        raise BadDigestError(f"{where}: downloaded bytes do not match crc32c "
                             f"{checksum.to_hex(want or 0)} ({attempts} tries)")
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"{where}: cannot write {path}: {e.strerror}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def range_into_file(read: RangeReader, fd: int, r: Range) -> int:
    """The ``range_into`` of :func:`get_file_verified` for a streaming ``read``: bytes
    ``r = (offset, length)`` into ``fd`` at the same offsets; returns their CRC32C, taken
    as they arrive (a range started over starts it over too)."""
    offset, length = r
    crc = 0

    def sink(pos: int, data: bytes) -> None:
        nonlocal crc
        if pos == offset:
            crc = 0
        os.pwrite(fd, data, pos)
        crc = checksum.extend(crc, data)

    read(offset, length, sink)
    start_writeback(fd, offset, length)  # on the disk while the other ranges arrive
    return crc


def read_ranges(read: RangeReader, offset: int, length: int, *, part: int,
                parallel: Callable[[list[Range], Callable[[Range], None]], object]
                ) -> bytes:
    """Bytes [offset, offset+length) streamed through ``read`` in ranges of ``part``
    bytes on the backend's pool, into one buffer: a streaming backend's ``get_range``
    once the object is known to exist. Not verified (see ``Storage.get_range``)."""
    buf = bytearray(length)
    view = memoryview(buf)

    def sink(pos: int, data: bytes) -> None:
        view[pos - offset:pos - offset + len(data)] = data

    parallel(split(offset, length, part), lambda r: read(r[0], r[1], sink))
    return bytes(buf)
