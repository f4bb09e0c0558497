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

__all__ = [
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
