"""Frozen, keyword-only configuration of :class:`tierckpt.CheckpointManager`."""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path

from tierckpt.errors import ConfigError
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.policy.units import check_count


class OnSaveError(str, enum.Enum):
    """What the next ``save()`` does when the previous background save failed.

    ``RAISE`` (default): raise :class:`SaveError` on every rank. ``CONTINUE``: log the error
    (``save_failed`` event and the ``tierckpt`` logger) and go on with the new save; the
    previous complete checkpoint stays the one a restart resumes from. ``wait()`` and
    ``close()`` always raise.
    """

    RAISE = "raise"
    CONTINUE = "continue"


class Verify(str, enum.Enum):
    """How much of a tier-1 candidate is checked before it is restored.

    ``SIZES``: marker digest, manifest, and every file's size (cheap, the default);
    ``FULL``: also every file's CRC32C (reads every byte once more).
    """

    SIZES = "sizes"
    FULL = "full"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """What a :class:`CheckpointManager` does; every field is validated on construction.

    ``tier1``: this process's tier-1 root (node-local or shared; domains are discovered).
    ``keep_last``: complete checkpoints kept on tier 1 (pinned ones are kept in addition).
    ``verify``: see :class:`Verify`. ``write_threads``: files written in parallel per rank.
    ``collective_timeout_s``: how long a background save or a restore waits for other ranks
    before failing (a dead peer is reported in this time, not the 30-minute default).
    ``wait_timeout_s``: how long ``save()``/``wait()`` wait for a previous save to finish.
    ``file_mode``/``dir_mode``: permissions of created files and directories.
    ``fsync``: fsync files and directories (turning it off voids the durability promise;
    for tests of throughput only). ``direct_io``: write shards with O_DIRECT (falls back to
    buffered I/O where the file system refuses it). ``background_nice``: niceness added to
    the background writer threads (Linux), so a save yields the CPU to training; 0 keeps
    them at the training thread's priority. ``on_save_error``: see :class:`OnSaveError`.
    ``tier2``: ``s3://bucket/prefix`` or ``file:///path``; restore falls back to it, and
    (with ``start_uploader``) one low-priority uploader process per tier-1 root copies every
    ``upload_every``-th committed step there. ``tier2_keep_last``/``tier2_keep_every``:
    tier-2 retention (newest K2, plus every M-th step forever; 0 = none).
    ``upload_drain_s``: on ``close()``, give the uploader up to this long to copy what is
    still due (0: stop it at once; it resumes from its recorded state next time).
    """

    tier1: Path
    keep_last: int = 3
    verify: Verify = Verify.SIZES
    write_threads: int = 1
    collective_timeout_s: float = 300.0
    wait_timeout_s: float = 3600.0
    file_mode: int = 0o640
    dir_mode: int = 0o750
    fsync: bool = True
    direct_io: bool = True
    background_nice: int = 10
    on_save_error: OnSaveError = OnSaveError.RAISE
    tier2: str | None = None
    upload_every: int = 1
    tier2_keep_last: int = 3
    tier2_keep_every: int = 0
    start_uploader: bool = True
    upload_drain_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.tier1, str | os.PathLike):
            raise ConfigError(f"tier1 must be a path, got {type(self.tier1).__name__}")
        object.__setattr__(self, "tier1", Path(self.tier1).expanduser().absolute())
        try:
            object.__setattr__(self, "verify", Verify(self.verify))
        except ValueError:
            raise ConfigError(f"verify must be one of {[v.value for v in Verify]}, "
                              f"got {self.verify!r}") from None
        try:
            object.__setattr__(self, "on_save_error", OnSaveError(self.on_save_error))
        except ValueError:
            raise ConfigError(f"on_save_error must be one of {[v.value for v in OnSaveError]}, "
                              f"got {self.on_save_error!r}") from None
        _ = self.retention  # a RetentionPolicy: validates its knobs (one place for all)
        check_count("write_threads", self.write_threads)
        if not isinstance(self.background_nice, int) or not 0 <= self.background_nice <= 19:
            raise ConfigError(f"background_nice must be an int in [0, 19], got "
                              f"{self.background_nice!r}")
        if self.tier2 is not None and (not isinstance(self.tier2, str) or not any(
                self.tier2.startswith(s) for s in ("s3://", "file://", "memory://"))):
            raise ConfigError(f"tier2 must be an s3://bucket/prefix or file:///path URL, got "
                              f"{self.tier2!r}")
        if not isinstance(self.upload_drain_s, int | float) or self.upload_drain_s < 0:
            raise ConfigError(f"upload_drain_s must be >= 0 seconds, got {self.upload_drain_s!r}")
        for name in ("collective_timeout_s", "wait_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or v <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("file_mode", "dir_mode"):
            mode = getattr(self, name)
            if not isinstance(mode, int) or mode & 0o002:
                raise ConfigError(f"{name} must be an int mode that is not world-writable, "
                                  f"got {mode!r}")

    @property
    def retention(self) -> RetentionPolicy:
        """What each tier keeps (``keep_last``, ``upload_every``, ``tier2_keep_*``)."""
        return RetentionPolicy(keep_last=self.keep_last, upload_every=self.upload_every,
                               tier2_keep_last=self.tier2_keep_last,
                               tier2_keep_every=self.tier2_keep_every)
