"""tierckpt: async, sharded, verified two-tier checkpoints for PyTorch that resume exactly."""

from __future__ import annotations

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

from tierckpt.config import ManagerConfig, Verify
from tierckpt.data import ResumableSampler
from tierckpt.distributed import DistInfo, init_distributed
from tierckpt.manager import CheckpointManager
from tierckpt.resume import RestoreInfo
from tierckpt.saver import SaveHandle, SaveResult
from tierckpt.state import TrainState
from tierckpt.watchdog import StepWatchdog

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
