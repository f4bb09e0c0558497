"""The exception tree, on top of the builtins so callers can catch broadly or narrowly.

    CheckpointError(RuntimeError)            every error tierckpt raises on purpose
    ├── ConfigError(CheckpointError, ValueError)     bad arguments or configuration: fix the call
    │   └── StateMismatchError(ConfigError)  the model's keys/shapes do not match a checkpoint
    ├── NoCheckpointError(CheckpointError, FileNotFoundError)   nothing complete to restore
    ├── IntegrityError(CheckpointError)      bytes or metadata do not match what was committed
    │   ├── SignatureError(IntegrityError)   manifest signature missing or wrong
    │   ├── MissingFilesError(IntegrityError)    intact, but files this node needs are
    │   │                                    elsewhere (fetchable from tier 2; not damage)
    │   ├── UnsafeCheckpointError(IntegrityError)    DCP's pickled ``.metadata`` names a
    │   │                                    global outside its allowlist (maybe planted)
    │   └── CorruptDataError(IntegrityError)     verified, yet its data failed to load
    │                                        (CRC found while reading, unreadable record)
    ├── LockError(CheckpointError)           another job (or uploader) holds the tier-1 root,
    │                                        or its file system cannot flock
    ├── HealError(CheckpointError)           a heal could not complete: exit, the launcher
    │                                        restarts the whole job
    ├── Tier2OutageError(CheckpointError)    the only copy is on a tier 2 that did not answer
    │                                        within ``Tier2.outage_wait_s``
    ├── SaveError(CheckpointError)           a background save failed (raised at the next
    │   │                                    save()/wait()/close() on every rank)
    │   ├── DiskFullError(SaveError)         a tier's file system is full (ENOSPC)
    │   └── StagingRaceError(SaveError)      an overlapped copy's tensor changed in place
    ├── StorageError(CheckpointError, OSError)   a storage backend failed after its retries
    │   ├── ObjectNotFoundError(StorageError, FileNotFoundError)   a read of a missing key
    │   ├── ObjectExistsError(StorageError, FileExistsError)   a create-only put lost
    │   └── BadDigestError(StorageError, IntegrityError)   bytes do not match their CRC32C
    └── NoticeSourceError(CheckpointError, OSError)   a notice poller's endpoint (cloud
                                             metadata) did not answer in time, or answered
                                             something it cannot read

``UploadStopped`` is internal control flow of the uploader (never escapes it).

DCP's own ``CheckpointException`` derives from ``BaseException``; tierckpt converts it into
``SaveError``/``CheckpointError`` at the boundary so ``except Exception`` works for callers.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Root of every error tierckpt raises deliberately."""


class ConfigError(CheckpointError, ValueError):
    """An argument or configuration value is invalid; the message names what to change."""


class StateMismatchError(ConfigError):
    """The state to restore does not match the checkpoint (missing keys, other shapes): the
    user's model changed, the checkpoint is fine. Nothing is quarantined; the message names
    the first mismatches and whether anything was already loaded."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete, valid checkpoint exists where one was required."""


class IntegrityError(CheckpointError):
    """Stored bytes, manifest or marker do not match what was committed."""


class SignatureError(IntegrityError):
    """A manifest is unsigned or its HMAC does not verify under the configured key."""


class MissingFilesError(IntegrityError):
    """A checkpoint is intact but lacks files this domain needs (node-local tier 1 after a
    reshard, or a replaced node): fetchable from tier 2, not a reason to quarantine it.
    ``missing`` names them."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class UnsafeCheckpointError(IntegrityError):
    """A checkpoint's ``.metadata`` pickle references a global (a class or function) outside
    what DCP's checkpoint metadata pickles: it may have been planted to run code on load.
    Nothing of it was called; restore quarantines the checkpoint and falls back to the next
    older step. ``refused`` is the global (``module.qualname``), ``source`` the file.
    (Keyword defaults keep it picklable: DCP gathers rank errors with pickle.)"""

    def __init__(self, message: str, *, refused: str = "", source: str = "") -> None:
        super().__init__(message)
        self.refused = refused
        self.source = source


class LockError(CheckpointError):
    """Another job holds the tier-1 root, or its file system cannot lock it (no ``flock``);
    two writers must never share one."""


class HealError(CheckpointError):
    """A heal could not complete (no next generation, the group did not re-form, the state
    did not load): this process must exit so the launcher falls back to a full restart."""


class Tier2OutageError(CheckpointError):
    """No tier 1 (or tier 0) holds a checkpoint and tier 2, which may hold the run, did not
    answer for ``Tier2.outage_wait_s``: starting from scratch would train over its history,
    so the start fails instead. Run the job again once tier 2 answers."""


class SaveError(CheckpointError):
    """A background save failed; raised at the next save(), wait() or close()."""


class DiskFullError(SaveError):
    """A save failed because a tier's file system is full (ENOSPC on some rank). Nothing of
    that save exists; the previous complete checkpoint stays the restore point. ``tier``
    (``"tier0"``/``"tier1"``), ``path``, ``free`` and ``needed`` (bytes, this rank's view)
    say what to free; a launcher can tell it from a crash by its type. (Keyword defaults
    keep it picklable.)"""

    def __init__(self, message: str, *, tier: str = "", path: str = "", free: int = 0,
                 needed: int = 0) -> None:
        super().__init__(message)
        self.tier, self.path, self.free, self.needed = tier, path, free, needed


class StagingRaceError(SaveError):
    """With ``staging="overlap"``: a tensor copied in the background was changed in place
    before its copy landed (a write outside ``optimizer.step()``); that save fails."""


class StorageError(CheckpointError, OSError):
    """A storage backend operation failed after retries."""


class CorruptDataError(IntegrityError):
    """A checkpoint that verified failed while its data was read (a CRC32C mismatch found
    while reading, a short read, a record that does not unpickle): restore quarantines it
    and falls back to the next older step."""


class Tier2CopyDamagedError(IntegrityError):
    """A step chosen from tier 2 could not be fetched because its bytes there are damaged
    or missing (a content object failed its CRC32C, or is gone while the step's marker is
    there): restore skips that step, logged, and chooses again. ``step`` names it."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The key does not exist (a read of a missing object)."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-only put (``if_none_match=True``) found the key holding different bytes."""


class BadDigestError(StorageError, IntegrityError):
    """Bytes do not match their CRC32C: the source changed since its checksum was taken,
    or the data was corrupted in transit or at rest (after the backend's digest retries)."""


class NoticeSourceError(CheckpointError, OSError):
    """A notice poller could not tell whether a termination is announced: its endpoint did
    not answer within the poller's timeout, refused, or sent a body it cannot parse. The
    preemption watcher logs it and polls again; the message names the URL and what to fix."""


class UploadStopped(Exception):
    """Internal: the uploader was asked to stop between two files."""
