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
    DiskFullError,
    HealError,
    IntegrityError,
    LockError,
    NoCheckpointError,
    SaveError,
    SignatureError,
    StagingRaceError,
    StateMismatchError,
    StorageError,
    Tier2OutageError,
    UnsafeCheckpointError,
)

_LAZY = {
    "AutoInterval": "tierckpt.policy.interval",
    "Every": "tierckpt.policy.interval",
    "CheckpointManager": "tierckpt.manager",
    "DistInfo": "tierckpt.runtime.distributed",
    "Failures": "tierckpt.save.config",
    "HangInfo": "tierckpt.runtime.watchdog",
    "ManagerConfig": "tierckpt.config",
    "OnSaveError": "tierckpt.save.config",
    "Preemption": "tierckpt.preempt.config",
    "EXIT_PREEMPTED": "tierckpt.preempt.config",
    "ReadCheck": "tierckpt.share.ranged",
    "RestoreInfo": "tierckpt.restore.loader",
    "ResumableSampler": "tierckpt.data",
    "SaveHandle": "tierckpt.save.saver",
    "SaveResult": "tierckpt.save.saver",
    "Staging": "tierckpt.save.config",
    "StepWatchdog": "tierckpt.runtime.watchdog",
    "Tier0": "tierckpt.tier0.config",
    "Tier2": "tierckpt.tier2.config",
    "TrainState": "tierckpt.state",
    "Verify": "tierckpt.restore.verify",
    "Writes": "tierckpt.save.config",
    "init_distributed": "tierckpt.runtime.distributed",
    "load": "tierckpt.share.loader",
    "LoadResult": "tierckpt.share.loader",
}

if TYPE_CHECKING:
    from tierckpt.config import ManagerConfig
    from tierckpt.data import ResumableSampler
    from tierckpt.manager import CheckpointManager
    from tierckpt.policy.interval import AutoInterval, Every
    from tierckpt.preempt.config import EXIT_PREEMPTED, Preemption
    from tierckpt.restore.loader import RestoreInfo
    from tierckpt.restore.verify import Verify
    from tierckpt.runtime.distributed import DistInfo, init_distributed
    from tierckpt.runtime.watchdog import HangInfo, StepWatchdog
    from tierckpt.save.config import Failures, OnSaveError, Staging, Writes
    from tierckpt.save.saver import SaveHandle, SaveResult
    from tierckpt.share.loader import LoadResult, load
    from tierckpt.share.ranged import ReadCheck
    from tierckpt.state import TrainState
    from tierckpt.tier0.config import Tier0
    from tierckpt.tier2.config import Tier2


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
    "EXIT_PREEMPTED",
    "AutoInterval",
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "DiskFullError",
    "DistInfo",
    "Every",
    "Failures",
    "HangInfo",
    "HealError",
    "IntegrityError",
    "LoadResult",
    "LockError",
    "ManagerConfig",
    "NoCheckpointError",
    "OnSaveError",
    "Preemption",
    "ReadCheck",
    "RestoreInfo",
    "ResumableSampler",
    "SaveError",
    "SaveHandle",
    "SaveResult",
    "SignatureError",
    "Staging",
    "StagingRaceError",
    "StateMismatchError",
    "StepWatchdog",
    "StorageError",
    "Tier0",
    "Tier2",
    "Tier2OutageError",
    "TrainState",
    "UnsafeCheckpointError",
    "Verify",
    "Writes",
    "__version__",
    "init_distributed",
    "load",
]
