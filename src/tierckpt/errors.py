"""The exception tree, on top of the builtins so callers can catch broadly or narrowly.

    CheckpointError(RuntimeError)            every error tierckpt raises on purpose
    ├── ConfigError(CheckpointError, ValueError)     bad arguments or configuration: fix the call
    ├── NoCheckpointError(CheckpointError, FileNotFoundError)   nothing complete to restore
    ├── IntegrityError(CheckpointError)      bytes or metadata do not match what was committed
    │   └── SignatureError(IntegrityError)   manifest signature missing or wrong
    ├── LockError(CheckpointError)           another job holds the tier-1 root
    ├── SaveError(CheckpointError)           a background save failed (raised at the next
    │                                        save()/wait()/close() on every rank)
    └── StorageError(CheckpointError, OSError)   a storage backend failed after its retries

DCP's own ``CheckpointException`` derives from ``BaseException``; tierckpt converts it into
``SaveError``/``CheckpointError`` at the boundary so ``except Exception`` works for callers.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Root of every error tierckpt raises deliberately."""


class ConfigError(CheckpointError, ValueError):
    """An argument or configuration value is invalid; the message names what to change."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete, valid checkpoint exists where one was required."""


class IntegrityError(CheckpointError):
    """Stored bytes, manifest or marker do not match what was committed."""


class SignatureError(IntegrityError):
    """A manifest is unsigned or its HMAC does not verify under the configured key."""


class LockError(CheckpointError):
    """Another job holds the tier-1 root; two writers must never share one."""


class SaveError(CheckpointError):
    """A background save failed; raised at the next save(), wait() or close()."""


class StorageError(CheckpointError, OSError):
    """A storage backend operation failed after retries."""
