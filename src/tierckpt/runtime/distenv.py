"""What torchrun's environment says about this process, and the backend and device it
implies: the rank, world size, local rank, node rank and restart count (a one-process job
on loopback when torchrun set none of them). Every bad value is a
:class:`~tierckpt.errors.ConfigError` that names the variable and what to set.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from tierckpt.errors import ConfigError


def positive_seconds(value: object, name: str) -> float:
    """``value``'s seconds; ConfigError naming ``name`` unless it is a positive timedelta."""
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ConfigError(f"{name} must be a positive datetime.timedelta, got {value!r}")
    return value.total_seconds()


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set; launch with torchrun "
                              "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def read_env() -> dict[str, Any]:
    """torchrun's view of this process: ``launched`` (RANK or WORLD_SIZE is set), ``rank``,
    ``world_size``, ``local_rank``, ``local_world_size``, ``node_rank``, ``restart_count``.
    Launched, MASTER_ADDR and MASTER_PORT must be set too; ConfigError otherwise."""
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", None if launched else 0)
    world_size = _env_int("WORLD_SIZE", None if launched else 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE")
    if launched:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise ConfigError(f"environment variable {name} is not set; launch with "
                                  "torchrun or set it to the rank-0 store address")
    return {
        "launched": launched, "rank": rank, "world_size": world_size,
        "local_rank": _env_int("LOCAL_RANK", 0 if not launched else rank),
        "local_world_size": _env_int("LOCAL_WORLD_SIZE", world_size),
        "node_rank": _env_int("GROUP_RANK", 0),
        "restart_count": _env_int("TORCHELASTIC_RESTART_COUNT", 0),
    }


def choose_backend(backend: str | None) -> str:
    """``backend``, or (None) ``"cpu:gloo,cuda:nccl"`` with CUDA and ``"gloo"`` without;
    ConfigError for an empty one or NCCL without CUDA."""
    cuda = torch.cuda.is_available()
    if backend is None:
        return "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if not isinstance(backend, str) or not backend:
        raise ConfigError(f"backend must be a non-empty string such as 'gloo', got {backend!r}")
    if "nccl" in backend and not cuda:
        raise ConfigError(f"backend {backend!r} needs CUDA, which is not available here; "
                          "use backend='gloo' (or None to choose automatically)")
    return backend


def choose_device(backend: str, local_rank: int) -> torch.device:
    """The CPU, or with NCCL ``cuda:<local_rank>``, made current; ConfigError when this node
    shows fewer devices than that."""
    if "nccl" not in backend:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are "
                          "visible; start at most that many processes per node")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


