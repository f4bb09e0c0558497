"""tierckpt: async, sharded, verified two-tier checkpoints for PyTorch that resume exactly.

Public names are imported lazily (PEP 562), so light entry points — the tier-2 uploader
process, the planner CLI — start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierckpt._version import __version__
from tierckpt.errors import (
    CheckpointError,
    ConfigError,
    IntegrityError,
    LockError,
    NoCheckpointError,
    SaveError,
    SignatureError,
    StorageError,
)

_LAZY = {
    "AutoInterval": "tierckpt.policy.interval",
    "Every": "tierckpt.policy.interval",
    "CheckpointManager": "tierckpt.manager",
    "DistInfo": "tierckpt.runtime.distributed",
    "HangInfo": "tierckpt.runtime.watchdog",
    "ManagerConfig": "tierckpt.config",
    "OnSaveError": "tierckpt.config",
    "RestoreInfo": "tierckpt.restore.loader",
    "ResumableSampler": "tierckpt.data",
    "SaveHandle": "tierckpt.save.saver",
    "SaveResult": "tierckpt.save.saver",
    "StepWatchdog": "tierckpt.runtime.watchdog",
    "TrainState": "tierckpt.state",
    "Verify": "tierckpt.config",
    "init_distributed": "tierckpt.runtime.distributed",
    "load": "tierckpt.share.loader",
    "LoadResult": "tierckpt.share.loader",
}

if TYPE_CHECKING:
    from tierckpt.config import ManagerConfig, OnSaveError, Verify
    from tierckpt.data import ResumableSampler
    from tierckpt.manager import CheckpointManager
    from tierckpt.policy.interval import AutoInterval, Every
    from tierckpt.restore.loader import RestoreInfo
    from tierckpt.runtime.distributed import DistInfo, init_distributed
    from tierckpt.runtime.watchdog import HangInfo, StepWatchdog
    from tierckpt.save.saver import SaveHandle, SaveResult
    from tierckpt.share.loader import LoadResult, load
    from tierckpt.state import TrainState


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "AutoInterval",
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "DistInfo",
    "Every",
    "HangInfo",
    "IntegrityError",
    "LoadResult",
    "LockError",
    "ManagerConfig",
    "NoCheckpointError",
    "OnSaveError",
    "RestoreInfo",
    "ResumableSampler",
    "SaveError",
    "SaveHandle",
    "SaveResult",
    "SignatureError",
    "StepWatchdog",
    "StorageError",
    "TrainState",
    "Verify",
    "__version__",
    "init_distributed",
    "load",
]
