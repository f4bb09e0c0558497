"""Host RAM of a process and its children, sampled in the background.

PSS (proportional set size, from ``/proc/<pid>/smaps_rollup``) is summed over the process
tree, so shared-memory staging buffers seen by a trainer and its writer process count once,
not twice. Falls back to RSS where smaps_rollup is missing.
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


def _pss_bytes(pid: int) -> int:
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        except OSError:
            continue
    return 0


def tree_pss(pid: int | None = None) -> int:
    """Bytes of PSS of ``pid`` (default: this process) and all its descendants."""
    todo, total = [pid or os.getpid()], 0
    while todo:
        current = todo.pop()
        total += _pss_bytes(current)
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
