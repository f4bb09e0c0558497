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

from tierckpt.config import ManagerConfig, Verify  # noqa: E402
from tierckpt.data import ResumableSampler  # noqa: E402
from tierckpt.manager import CheckpointManager  # noqa: E402
from tierckpt.resume import RestoreInfo  # noqa: E402
from tierckpt.saver import SaveHandle, SaveResult  # noqa: E402
from tierckpt.state import TrainState  # noqa: E402

__all__ = [
    "CheckpointManager",
    "ManagerConfig",
    "RestoreInfo",
    "ResumableSampler",
    "SaveHandle",
    "SaveResult",
    "TrainState",
    "Verify",
    "CheckpointError",
    "ConfigError",
    "IntegrityError",
    "LockError",
    "NoCheckpointError",
    "SaveError",
    "SignatureError",
    "StorageError",
    "__version__",
]
