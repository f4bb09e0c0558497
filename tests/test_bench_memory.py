"""bench.memory counts what a process tree holds (anonymous + shared memory, shared pages
once), not file-backed pages it merely mapped."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
from pathlib import Path

from bench.memory import PeakSampler, tree_pss

MiB = 1 << 20


def test_anonymous_memory_counts_and_mapped_file_pages_do_not(tmp_path: Path) -> None:
    before = tree_pss()
    anon = bytearray(64 * MiB)
    anon[::4096] = b"x" * len(anon[::4096])  # every page touched
    grown = tree_pss() - before
    assert 60 * MiB < grown < 72 * MiB, grown
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(32 * MiB))
    before = tree_pss()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) >= 0  # every page faulted in
        assert abs(tree_pss() - before) < 8 * MiB
    del anon


def _hold(name: str, ready: object, stop: object) -> None:
    fd = os.open(name, os.O_RDWR)
    with mmap.mmap(fd, 48 * MiB) as m:
        m[::4096] = b"y" * len(m[::4096])
        ready.set()  # type: ignore[attr-defined]
        stop.wait(30)  # type: ignore[attr-defined]
    os.close(fd)


def test_shared_memory_in_a_child_counts_once() -> None:
    name = f"/dev/shm/tierckpt-bench-memory-{os.getpid()}"
    with open(name, "wb") as f:
        f.truncate(48 * MiB)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    fd = os.open(name, os.O_RDWR)
    try:
        with mmap.mmap(fd, 48 * MiB) as mine:
            mine[::4096] = b"z" * len(mine[::4096])  # this process maps every page too
            with PeakSampler(interval=0.01) as sampler:
                base = sampler.peak
                child = ctx.Process(target=_hold, args=(name, ready, stop))
                child.start()
                assert ready.wait(60)
                held = tree_pss()
                stop.set()
                child.join(30)
            # the child's interpreter adds its own anonymous memory; the 48 MiB of shared
            # pages must not be counted a second time
            assert held - base < 40 * MiB, (held - base) / MiB
    finally:
        os.close(fd)
        os.unlink(name)
