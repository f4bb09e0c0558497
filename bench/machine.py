"""Facts about the machine a run was measured on, so numbers are read in context.

``fsync_probe`` answers "is fsync honoured?" as well as software can: a 4 KiB write + fsync
that returns in well under 50 µs never reached a device (a host cache, ``cache=unsafe`` VM,
tmpfs or ``eatmydata``); the block device's ``queue/write_cache`` setting is recorded too.
It is a heuristic, stated as such in the results.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

_FSYNC_HONOURED_MIN_S = 50e-6


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, fs type, source device) of the mount holding ``path``."""
    best = ("/", "unknown", "unknown")
    target = str(path.resolve())
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mount_point = left.split()[4]
            fields = right.split()
            inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best[0]) and len(fields) >= 2:
                best = (mount_point, fields[0], fields[1])
    return best


def _write_cache_setting(device: str) -> str | None:
    name = Path(device).name
    for candidate in (name, name.rstrip("0123456789").removesuffix("p")):
        path = Path("/sys/block") / candidate / "queue" / "write_cache"
        if path.exists():
            return path.read_text().strip()
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fsync_probe(directory: Path, rounds: int = 32) -> dict[str, Any]:
    """Median seconds of a 4 KiB append + fsync in ``directory``, and the honoured verdict."""
    path = directory / ".bench-fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    latencies = []
    try:
        for _ in range(rounds):
            os.write(fd, b"\0" * 4096)
            start = time.perf_counter()
            os.fsync(fd)
            latencies.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    median = statistics.median(latencies)
    return {"median_fsync_s": median, "honoured": median >= _FSYNC_HONOURED_MIN_S,
            "rule": f"4 KiB write + fsync median >= {_FSYNC_HONOURED_MIN_S * 1e6:.0f} us"}


def machine_facts(target_dir: Path) -> dict[str, Any]:
    """Cores, memory, CPU, kernel, versions, load, and the target directory's filesystem."""
    mount_point, fs_type, device = _mount_of(target_dir)
    mem_total = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_total = int(line.split()[1]) * 1024
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "mem_total_bytes": mem_total,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()),
        "target_dir": str(target_dir),
        "target_fs": fs_type,
        "target_mount": mount_point,
        "target_device": device,
        "device_write_cache": _write_cache_setting(device),
    }
