"""Host RAM of a process and its children, sampled in the background.

The memory a process holds that the kernel cannot drop: anonymous plus shared-memory PSS
(``Pss_Anon`` + ``Pss_Shmem`` from ``/proc/<pid>/smaps_rollup``: heap, staging and I/O
buffers, ``/dev/shm`` buffers), summed over the process tree, so shared-memory buffers seen
by a trainer and its writer process count once, not twice. File-backed pages are left out:
the first save pages in ~5 MiB of libtorch code (zip writer, serialisation) that is shared,
clean and reclaimable, and it was counted as "extra RAM" of the checkpoint before. Falls
back to all of PSS on kernels without ``Pss_Anon``, then to RSS.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return out


def _held_bytes(pid: int) -> int:
    try:
        rollup = {k: int(v.split()[0]) * 1024 for k, _, v in
                  (line.partition(":") for line in
                   Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])}
    except (OSError, ValueError):
        rollup = {}
    if "Pss_Anon" in rollup:
        return rollup["Pss_Anon"] + rollup.get("Pss_Shmem", 0)
    if "Pss" in rollup:
        return rollup["Pss"]
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss(pid: int | None = None) -> int:
    """Bytes held (anonymous + shared-memory PSS) by ``pid`` (default: this process) and all
    its descendants."""
    todo, total = [pid or os.getpid()], 0
    while todo:
        current = todo.pop()
        total += _held_bytes(current)
        todo += _children(current)
    return total


class PeakSampler:
    """Context manager sampling ``tree_pss()`` every ``interval`` seconds; ``peak`` is the max."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakSampler:
        self.peak = tree_pss()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.peak = max(self.peak, tree_pss())
