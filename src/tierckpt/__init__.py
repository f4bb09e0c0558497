"""tierckpt: async, sharded, verified two-tier checkpoints for PyTorch that resume exactly.

Public names are imported lazily (PEP 562), so light entry points — the tier-2 uploader
process, the planner CLI — start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "tierckpt.manager",
    "DistInfo": "tierckpt.distributed",
    "ManagerConfig": "tierckpt.config",
    "OnSaveError": "tierckpt.config",
    "RestoreInfo": "tierckpt.resume",
    "ResumableSampler": "tierckpt.data",
    "SaveHandle": "tierckpt.saver",
    "SaveResult": "tierckpt.saver",
    "StepWatchdog": "tierckpt.watchdog",
    "TrainState": "tierckpt.state",
    "Verify": "tierckpt.config",
    "init_distributed": "tierckpt.distributed",
}

if TYPE_CHECKING:
    from tierckpt.config import ManagerConfig, OnSaveError, Verify
    from tierckpt.data import ResumableSampler
    from tierckpt.distributed import DistInfo, init_distributed
    from tierckpt.manager import CheckpointManager
    from tierckpt.resume import RestoreInfo
    from tierckpt.saver import SaveHandle, SaveResult
    from tierckpt.state import TrainState
    from tierckpt.watchdog import StepWatchdog


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
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "DistInfo",
    "IntegrityError",
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
]
