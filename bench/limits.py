"""The physical limits, measured in the same run as the peers.

- copy: two threads ``copy_`` the state into buffers allocated (and touched) beforehand;
  the floor for any blocking time C that makes a host copy.
- write (buffered): the state's bytes written sequentially to one file, then fsync.
- write (O_DIRECT): the same byte count from a page-aligned buffer with ``O_DIRECT``, then
  fsync; the floor for a durable tier-1 write. Skipped (with a note) where the filesystem
  refuses O_DIRECT (tmpfs).
- cold read: the buffered file read sequentially into a reused buffer after the page cache
  dropped it (see ``pagecache``); ``cold`` says whether it really was.
- cold read × N (``cold_read_x<N>``, for each world size N > 1): N threads each read their
  own 1/N of the same evicted file at once — the disk's aggregate rate when N ranks of one
  node restore together, which is the fair floor for a world-N restore on one disk.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.measure import Measurement, best_of
from bench.pagecache import evict

_CHUNK = 16 << 20
_ALIGN = 4096


def copy_runner(state: dict[str, torch.Tensor], threads: int = 2) -> Callable[[], float]:
    """The copy limit's procedure, set up once: a function that times ``threads`` Python
    threads ``copy_``-ing the state into buffers allocated (and touched) here, largest
    tensors spread first. Each call is one timed copy, torch at one thread per copy thread."""
    tensors = sorted(state.values(), key=lambda t: -t.numel())
    groups: list[list[torch.Tensor]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for t in tensors:
        i = loads.index(min(loads))
        groups[i].append(t)
        loads[i] += t.numel()
    dests = [[torch.zeros_like(t) for t in group] for group in groups]

    def work(i: int) -> None:
        for dst, src in zip(dests[i], groups[i], strict=True):
            dst.copy_(src)

    def timed() -> float:
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one core per copy thread, no intra-op oversubscription
        try:
            return timed_threads(work, threads)
        finally:
            torch.set_num_threads(saved_threads)
    return timed


def copy_limit(state: dict[str, torch.Tensor], repeats: int, threads: int = 2) -> Measurement:
    """Best seconds for ``threads`` Python threads to ``copy_`` the state into existing buffers."""
    copy = copy_runner(state, threads)
    runs = [copy() for _ in range(repeats + 1)]  # the first warms caches and the allocator
    return best_of(runs[1:], sum(t.numel() * t.element_size() for t in state.values()),
                   threads=threads)


def _write_buffered(path: Path, state: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for t in state.values():
            f.write(t.numpy().data)  # the tensor's own memory, no copy
        os.fsync(f.fileno())
    return time.perf_counter() - start


def _write_direct(path: Path, nbytes: int, buf: mmap.mmap) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        start = time.perf_counter()
        left = nbytes
        view = memoryview(buf)
        while left > 0:
            n = min(left, _CHUNK)
            os.write(fd, view[:n])
            left -= n
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def write_limits(directory: Path, state: dict[str, torch.Tensor],
                 repeats: int) -> dict[str, Measurement]:
    """Buffered+fsync and O_DIRECT+fsync sequential writes of the state's byte count.

    Leaves ``directory/limit-buffered.bin`` behind for ``cold_read_limit``.
    """
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffered = directory / "limit-buffered.bin"
    runs = []
    for _ in range(repeats):
        buffered.unlink(missing_ok=True)
        runs.append(_write_buffered(buffered, state))
    out = {"write_buffered_fsync": best_of(runs, nbytes)}
    aligned = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    direct = directory / "limit-direct.bin"
    buf = mmap.mmap(-1, _CHUNK)  # anonymous mappings are page aligned
    buf.write(os.urandom(1 << 20) * (_CHUNK >> 20))
    try:
        runs = []
        for _ in range(repeats):
            direct.unlink(missing_ok=True)
            runs.append(_write_direct(direct, aligned, buf))
        out["write_odirect_fsync"] = best_of(runs, aligned, chunk_bytes=_CHUNK)
    except OSError as exc:  # EINVAL: this filesystem has no O_DIRECT
        out["write_odirect_fsync"] = Measurement(0.0, aligned, note=f"O_DIRECT refused: {exc}")
    finally:
        buf.close()
        direct.unlink(missing_ok=True)
    return out


def cold_read_limit(path: Path, repeats: int) -> tuple[Measurement, dict[str, Any]]:
    """Sequential read of ``path`` into a reused 16 MiB buffer after evicting it each time."""
    buf = bytearray(_CHUNK)
    runs, evictions = [], []
    for _ in range(repeats):
        ev = evict([path])
        evictions.append(ev.to_json())
        with open(path, "rb", buffering=0) as f:
            start = time.perf_counter()
            while f.readinto(buf):
                pass
            runs.append(time.perf_counter() - start)
    cold = all(e["honoured"] for e in evictions)
    return (best_of(runs, path.stat().st_size, cold=cold),
            {"method": evictions[-1]["method"], "honoured": cold, "evictions": evictions})


def read_range(path: Path, pos: int, end: int) -> None:
    """Read bytes ``[pos, end)`` of ``path`` front to back into a reused 16 MiB buffer."""
    view = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while pos < end:
            n = os.preadv(f.fileno(), [view[:min(_CHUNK, end - pos)]], pos)
            if n <= 0:
                break
            pos += n


def timed_threads(fn: Callable[[int], None], n: int) -> float:
    """Seconds for ``n`` threads running ``fn(0)`` … ``fn(n - 1)`` at once."""
    workers = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def concurrent_cold_read_limit(path: Path, readers: int, repeats: int) -> Measurement:
    """``readers`` threads each read their own contiguous 1/readers of ``path`` (evicted
    first) at once; aggregate bytes ÷ wall seconds."""
    size = path.stat().st_size
    bounds = [size * i // readers for i in range(readers + 1)]
    runs, cold = [], True

    for _ in range(repeats):
        cold = cold and evict([path]).honoured
        runs.append(timed_threads(lambda i: read_range(path, bounds[i], bounds[i + 1]),
                                  readers))
    return best_of(runs, size, f"{readers} concurrent readers, 1/{readers} of the file each",
                   cold=cold)


def measure_limits(directory: Path, state: dict[str, torch.Tensor], repeats: int,
                   worlds: tuple[int, ...] = ()) -> tuple[dict[str, Measurement],
                                                          dict[str, Any]]:
    """All limits (a concurrent cold read for each world size > 1); returns the
    measurements and the cache-drop record."""
    limits = {"copy_2threads": copy_limit(state, max(5, repeats))}  # cheap: take more tries
    limits.update(write_limits(directory, state, repeats))
    buffered = directory / "limit-buffered.bin"
    try:
        limits["cold_read"], cache = cold_read_limit(buffered, repeats)
        for w in sorted(set(worlds) - {1}):
            limits[f"cold_read_x{w}"] = concurrent_cold_read_limit(buffered, w, repeats)
    finally:
        buffered.unlink(missing_ok=True)
    return limits, cache
