"""What ``/proc`` says about a process: its parent, its start time, its command line.

Linux only; every reader returns None (or an empty string) where ``/proc`` cannot say — no
such process, another OS — and never raises.
"""

from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and
    parentheses): ``[0]`` the state, ``[1]`` the parent pid, ``[19]`` the start time in
    clock ticks after boot. None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def _int_field(pid: int | str, i: int) -> int | None:
    fields = stat_fields(pid)
    try:
        return int(fields[i]) if fields else None
    except ValueError:
        return None


def start_ticks(pid: int | str) -> int | None:
    """The process's start time (clock ticks after boot), or None."""
    return _int_field(pid, 19)


def parent(pid: int | str) -> int | None:
    """The parent's pid, or None."""
    return _int_field(pid, 1)


def cmdline(pid: int | str) -> str | None:
    """The command line, arguments joined by spaces, or None."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()
