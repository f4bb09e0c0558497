"""Who holds a lease, in terms a reader on the same machine can check: the kernel's boot
id, the PID namespace, the process id and its start time. A lease whose holder is on this
boot, in this PID namespace, and no longer running (killed) holds nothing back; a holder
anywhere else — another host, another container, another boot — cannot be judged from
here and is waited for as before.

Linux only (``/proc``); elsewhere :func:`me` is empty and :func:`gone` is always False.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tierckpt._proc import start_ticks


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _pid_ns() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def me() -> dict[str, object]:
    """This process as a lease's holder (empty where /proc cannot say)."""
    boot, ns = _read("/proc/sys/kernel/random/boot_id"), _pid_ns()
    start = start_ticks(os.getpid())
    if boot is None or ns is None or start is None:
        return {}
    return {"boot": boot, "pid_ns": ns, "pid": os.getpid(), "start": start}


def gone(holder: Mapping[str, object]) -> bool:
    """True only when ``holder`` (what :func:`me` wrote) ran on this boot in this PID
    namespace and no process with its id and start time runs now."""
    here = me()
    if not here or any(holder.get(k) != here[k] for k in ("boot", "pid_ns")):
        return False
    pid, start = holder.get("pid"), holder.get("start")
    if not isinstance(pid, int) or not isinstance(start, int) or isinstance(pid, bool):
        return False
    return start_ticks(pid) != start
