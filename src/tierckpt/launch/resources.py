"""What one node of a job asks its scheduler for — GPUs, CPUs, memory — in Slurm's and
Kubernetes' spelling. Pure.

Memory is one spelling for both launchers: a whole number with a binary unit, ``M``/``Mi``,
``G``/``Gi`` or ``T``/``Ti`` (``512G`` = ``512Gi`` = 512 × 1024 MiB, as Slurm reads
``--mem``). Kubernetes gets it in ``Mi``/``Gi``, Slurm in ``M``/``G``.
"""

from __future__ import annotations

import re
from typing import Any

from tierckpt.errors import ConfigError

_MEMORY = re.compile(r"^\s*(\d+)\s*([MGT])i?B?\s*$", re.IGNORECASE)
_MIB = {"M": 1, "G": 1024, "T": 1024 * 1024}


def parse_memory(text: str, flag: str) -> int:
    """``text`` (e.g. ``512G``, ``64Gi``, ``8000M``) in MiB; ConfigError naming ``flag``."""
    m = _MEMORY.match(text)
    if m is None or int(m.group(1)) == 0:
        raise ConfigError(f"{flag} {text!r}: give a size with a binary unit, e.g. 512G or "
                          "64Gi (M, G, T; 1G = 1024M)")
    return int(m.group(1)) * _MIB[m.group(2).upper()]


def k8s_memory(mib: int) -> str:
    """MiB as a Kubernetes quantity (``64Gi``, ``1536Mi``)."""
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def slurm_memory(mib: int) -> str:
    """MiB as Slurm's ``--mem`` (``64G``, ``1536M``)."""
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def check_counts(**counts: int) -> None:
    """Each count (``gpus_per_node=8``) is an int >= 0; ConfigError naming its flag."""
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a whole number >= 0 "
                              f"(0: not asked for), got {n!r}")


def sbatch_lines(*, gpus: int, cpus: int, memory_mib: int) -> list[str]:
    """The ``#SBATCH`` lines for one node (one task per node: CPUs are the task's)."""
    lines = []
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    if cpus:
        lines.append(f"#SBATCH --cpus-per-task={cpus}")
    if memory_mib:
        lines.append(f"#SBATCH --mem={slurm_memory(memory_mib)}")
    return lines


def k8s_resources(*, gpus: int, cpus: int, memory_mib: int, ram_volume_mib: int = 0
                  ) -> dict[str, Any]:
    """A container's ``resources``: GPUs as requests and limits (``nvidia.com/gpu``), CPUs
    as a request (a CPU limit throttles the data loader), memory as a request and a limit
    that add ``ram_volume_mib`` (a memory-backed ``emptyDir`` is charged to the
    container's memory). {} when nothing is asked for."""
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = gpus
    if cpus:
        requests["cpu"] = cpus
    if memory_mib:
        requests["memory"] = limits["memory"] = k8s_memory(memory_mib + ram_volume_mib)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out
