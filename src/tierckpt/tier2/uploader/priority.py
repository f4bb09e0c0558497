"""The uploader process's manners: lowest CPU and I/O priority, and no orphan.

Best effort on every platform; Linux gets the idle I/O class (``ioprio_set``) and
``PR_SET_PDEATHSIG``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import signal
import sys
import threading

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}
_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "arm64": 31}
_IOPRIO_CLASS_IDLE = 3
IOPRIO_IDLE = _IOPRIO_CLASS_IDLE << 13
"""``ioprio_get`` value of the idle I/O class (level 0)."""


def lower_priority() -> dict[str, bool]:
    """Make this process nice 19 and idle I/O class (best effort; returns what applied)."""
    applied = {"nice": False, "ioprio": False}
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))
        applied["nice"] = True
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is not None and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        # ioprio_set(IOPRIO_WHO_PROCESS=1, pid 0 = self, class IDLE << 13)
        applied["ioprio"] = libc.syscall(nr, 1, 0, IOPRIO_IDLE) == 0
    return applied


def io_priority(pid: int = 0) -> int | None:
    """``ioprio_get`` of ``pid`` (0 = self): ``class << 13 | level``; None if unavailable."""
    nr = _IOPRIO_GET.get(platform.machine())
    if nr is None or not sys.platform.startswith("linux"):
        return None
    value = int(ctypes.CDLL(None, use_errno=True).syscall(nr, 1, pid))
    return None if value < 0 else value


def exit_with_parent(parent: int, stop: threading.Event) -> None:
    """Set ``stop`` when ``parent`` (the rank that started this process) dies — a SIGKILLed
    rank must not leave an orphan uploading behind the restarted job's back. Linux sends
    SIGINT on the parent's death (PR_SET_PDEATHSIG; SIGTERM is a notice a job's uploader
    ignores); a watcher thread covers the window before prctl and other platforms."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGINT), 0, 0, 0)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent:
                stop.set()
    if os.getppid() != parent:
        stop.set()
    threading.Thread(target=watch, name="tierckpt-parent-watch", daemon=True).start()
