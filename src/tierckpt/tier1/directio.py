"""Write a file once, fast and durably: CRC32C on the same pass, O_DIRECT, double-buffered.

``DirectFile`` is what shard files are written through. Each ``write`` updates the CRC32C
from the caller's bytes and copies them into one of two page-aligned buffers; a full
buffer is handed to a writer thread (``os.write`` on an ``O_DIRECT`` descriptor, GIL
released) while the caller fills the other, so checksumming, copying and device I/O
overlap. A large write from page-aligned memory (a tensor's bytes in a staging buffer
that :class:`~tierckpt.save.staging.HostStager` allocated page-aligned) is not copied: it
is written straight from the caller's memory, in pieces, each checksummed just before it
is queued. For O_DIRECT its file offset must be page-aligned too, so zero padding is
inserted *before* the record being written (its header is still in the buffer); the
record's start moves, which :meth:`DirectFile.mark` reports, and the padding belongs to
no record (readers locate records by offset; the file CRC32C covers every byte).
Writing around the page cache is what lets a save approach the device's sequential write
limit, and it keeps a 1 GiB checkpoint from evicting training data from the cache. The
tail is written padded to the block size and the file truncated to its true length;
``close`` fsyncs (O_DIRECT does not make size or metadata durable).

File systems without O_DIRECT (tmpfs, some FUSE and network mounts) get the same class
with plain buffered writes: the contract — bytes, size, CRC32C, fsync — is identical.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tierckpt.format import checksum

ALIGN = 4096
DEFAULT_BUFFER = 4 * 1024 * 1024
ZERO_COPY_MIN = 1024 * 1024   # writes at least this large may skip the buffers
# With zero_copy only headers and records under ZERO_COPY_MIN pass through the buffers:
# 2 × 1 MiB keeps them in 1 MiB direct writes and 6 MiB per file off a save's peak RAM.
ZERO_COPY_BUFFER = 1024 * 1024
_PIECE = 16 * 1024 * 1024     # a zero-copy write is checksummed and queued in these


class DirectFile(io.RawIOBase):
    """Create ``path`` exclusively and write it sequentially (see the module docstring).

    ``crc`` and ``size`` describe everything written so far (padding included);
    :meth:`mark` ends a record and returns its ``(offset, length, CRC32C)`` (one CRC pass
    serves both). ``zero_copy=True`` lets large writes skip the buffers: the caller then
    promises that the memory it passes stays unchanged until :meth:`close` returns;
    ``zero_copied`` counts the bytes written that way. ``buffer_size`` defaults to
    ``DEFAULT_BUFFER``, or ``ZERO_COPY_BUFFER`` with ``zero_copy``. Errors from the writer thread
    (ENOSPC, EIO, ...) are re-raised by the next ``write`` or by ``close``. ``reuse=True``
    rewrites the existing file ``path`` (which nothing else may share) from its start instead
    of creating one, and truncates it to what was written: on tmpfs its pages are already
    allocated (:mod:`tierckpt.tier0.recycle`); with ``mapping`` (that file mapped shared,
    :class:`~tierckpt.tier0.pages.KeptMappings`; used with ``io_threads`` > 1 and buffered
    writes only) a write that falls inside the mapping and before the file's end or first
    hole when opened is a memcpy into the mapping instead of a ``pwrite``
    (``mapped_bytes`` counts those bytes). ``io_threads`` writes run at once, each at its
    own offset (``pwrite``): 1 keeps one stream in flight (a disk's sequential write); more
    let a copy into RAM (tmpfs) use several cores.
    """

    def __init__(self, path: str | os.PathLike[str], *, mode: int = 0o640,
                 direct: bool = True, fsync: bool = True,
                 buffer_size: int | None = None, zero_copy: bool = False,
                 reuse: bool = False, io_threads: int = 1,
                 mapping: mmap.mmap | None = None) -> None:
        super().__init__()
        if buffer_size is None:
            buffer_size = ZERO_COPY_BUFFER if zero_copy else DEFAULT_BUFFER
        if buffer_size % ALIGN:
            raise ValueError(f"buffer_size must be a multiple of {ALIGN}")
        flags = os.O_WRONLY | os.O_CLOEXEC | (0 if reuse else os.O_CREAT | os.O_EXCL)
        self._reuse = reuse
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, mode)
                self.direct = True
            except OSError:  # EINVAL: the file system does not do O_DIRECT
                if not reuse:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        if not self.direct:
            self._fd = os.open(path, flags, mode)
        self._fsync = fsync
        self._base_crc = 0   # CRC32C of bytes before the last mark
        self._base_size = 0
        self._span_crc = 0   # CRC32C of bytes since the last mark
        self.size = 0
        self._bufsize = buffer_size
        self._maps = [mmap.mmap(-1, buffer_size) for _ in range(2)]
        self._views = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self._cur = 0
        self._fill = 0
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="tierckpt-io")
        self._depth = max(1, io_threads)
        self._inflight: deque[Future[None]] = deque()
        self._buf_done: list[Future[None] | None] = [None, None]  # each buffer's last write
        self._flushed = 0  # file offset of the next byte handed to the writers
        self.zero_copy = zero_copy
        self.zero_copied = 0
        self._closed_fd = False
        self.error: OSError | None = None  # first I/O error (torch.save hides what we raise)
        self.mapped_bytes = 0
        self._map: np.ndarray | None = None
        self._map_end = 0  # bytes from offset 0 that may be copied into the mapping
        if mapping is not None and reuse and not self.direct and self._depth > 1:
            self._map = np.frombuffer(mapping, dtype=np.uint8)
            # only pages the file owns: a copy into a hole would allocate, and a full tmpfs
            # answers that with SIGBUS, not ENOSPC
            self._map_end = min(len(mapping), os.fstat(self._fd).st_size,
                                os.lseek(self._fd, 0, os.SEEK_HOLE))

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def write(self, b: Any) -> int:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        total = len(mv)
        if total == 0:
            return 0
        if self.zero_copy and total >= ZERO_COPY_MIN and self._zero_copy(mv):
            return total
        self._span_crc = checksum.extend(self._span_crc, mv)
        self._copy(mv)
        return total

    def _copy(self, mv: memoryview) -> None:
        src = np.frombuffer(mv, dtype=np.uint8)
        done, total = 0, len(mv)
        while done < total:
            take = min(self._bufsize - self._fill, total - done)
            self._views[self._cur][self._fill:self._fill + take] = src[done:done + take]
            self._fill += take
            done += take
            if self._fill == self._bufsize:
                self._submit(self._bufsize)
        self.size += total

    def _zero_copy(self, mv: memoryview) -> bool:
        """Write ``mv`` from the caller's memory (which must stay unchanged until
        ``close``); False, having done nothing, when alignment does not allow it."""
        addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data
        if self.direct and (addr % ALIGN or not self._align_record()):
            return False
        if self._fill:
            self._submit(self._fill)  # page-aligned length in direct mode (see above)
        bulk = len(mv) - len(mv) % ALIGN if self.direct else len(mv)
        for i in range(0, bulk, _PIECE):
            piece = mv[i:min(bulk, i + _PIECE)]
            self._span_crc = checksum.extend(self._span_crc, piece)
            self._queue(piece)
        self.size += bulk
        self.zero_copied += bulk
        if bulk < len(mv):
            self._span_crc = checksum.extend(self._span_crc, mv[bulk:])
            self._copy(mv[bulk:])
        return True

    def _align_record(self) -> bool:
        """Make the next byte's file offset page-aligned by inserting zeros before the
        current record, whose bytes so far must all still be in the buffer. False when
        they are not (or the buffer is too full): the caller copies instead."""
        pad = -self.size % ALIGN
        if pad == 0:
            return True
        record = self.size - self._base_size
        if record > self._fill or self._fill + pad > self._bufsize:
            return False
        view, start = self._views[self._cur], self._fill - record
        view[start + pad:self._fill + pad] = view[start:self._fill].copy()
        view[start:start + pad] = 0
        self._base_crc = checksum.combine(self._base_crc, checksum.extend(0, bytes(pad)), pad)
        self._base_size += pad
        self._fill += pad
        self.size += pad
        return True

    @property
    def crc(self) -> int:
        """CRC32C of everything written so far."""
        return checksum.combine(self._base_crc, self._span_crc, self.size - self._base_size)

    def mark(self) -> tuple[int, int, int]:
        """End a record: return ``(offset, length, CRC32C)`` of the bytes written since
        the last mark (or the start; alignment padding before them excluded) and begin the
        next record here."""
        record = (self._base_size, self.size - self._base_size, self._span_crc)
        self._base_crc, self._base_size, self._span_crc = self.crc, self.size, 0
        return record

    def _submit(self, nbytes: int) -> None:
        """Hand the current buffer's first ``nbytes`` to the writers and switch buffers
        (waiting until the other one's last write is done)."""
        self._buf_done[self._cur] = self._queue(memoryview(self._maps[self._cur])[:nbytes])
        self._cur ^= 1
        self._fill = 0
        done = self._buf_done[self._cur]
        if done is not None:
            self._reap(done)

    def _queue(self, buf: memoryview) -> Future[None]:
        """Write ``buf`` at the next offset on a writer thread (at most ``io_threads`` in
        flight: the oldest is waited for first)."""
        while len(self._inflight) >= self._depth:
            self._reap(self._inflight.popleft())
        fut = self._pool.submit(self._write_all, buf, self._flushed)
        if self._flushed + len(buf) <= self._map_end:
            self.mapped_bytes += len(buf)
        self._flushed += len(buf)
        self._inflight.append(fut)
        return fut

    def _write_all(self, buf: memoryview, offset: int) -> None:
        """Write ``buf`` at ``offset``: ``write`` when one write is in flight (they arrive
        in order, so the file's own offset is right: the syscall a disk save has always
        made, which the fault tests trace and fail), ``pwrite`` when several are; a copy
        when the mapping covers them."""
        if self._map is not None and offset + len(buf) <= self._map_end:
            np.copyto(self._map[offset:offset + len(buf)], np.frombuffer(buf, dtype=np.uint8))
            return
        done = 0
        while done < len(buf):
            if self._depth == 1:
                done += os.write(self._fd, buf[done:])
            else:
                done += os.pwrite(self._fd, buf[done:], offset + done)

    def _reap(self, fut: Future[None]) -> None:
        try:
            fut.result()
        except OSError as e:
            self.error = self.error or e
            raise

    def _wait(self) -> None:
        while self._inflight:
            self._reap(self._inflight.popleft())

    def abort(self) -> None:
        """Close without flushing (after a failure); the partial file stays for cleanup."""
        self._closed_fd = True
        self._pool.shutdown(wait=True)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._closed_fd:
                self._finish()
        finally:
            self._pool.shutdown(wait=True)
            self._map = None  # the mapping is its owner's: let it close
            if not self._closed_fd:
                os.close(self._fd)
                self._closed_fd = True
            for m in self._maps:
                with contextlib.suppress(BufferError):
                    m.close()
            super().close()

    def _finish(self) -> None:
        tail = self._fill
        if tail:
            padded = -(-tail // ALIGN) * ALIGN if self.direct else tail
            if padded > tail:
                self._views[self._cur][tail:padded] = 0
            self._submit(padded)
        self._wait()
        try:
            if (self.direct and tail) or self._reuse:
                os.ftruncate(self._fd, self.size)
            if self._fsync:
                os.fsync(self._fd)
        except OSError as e:
            self.error = self.error or e
            raise
