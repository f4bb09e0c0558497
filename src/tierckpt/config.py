"""Frozen, keyword-only configuration of :class:`tierckpt.CheckpointManager`."""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path

from tierckpt.errors import ConfigError
from tierckpt.policy.interval import AutoInterval, Every
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.policy.units import check_count, check_seconds
from tierckpt.tier2.storage.url import parse_url

STAGING_MODES = ("overlap", "sync")


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
    them at the training thread's priority. ``on_save_error``: see :class:`OnSaveError`;
    ``max_consecutive_save_failures``: with ``"continue"``, this many failed saves in a row
    raise anyway (a run that cannot checkpoint should not train on for days).
    ``tier2``: ``s3://bucket/prefix`` or ``file:///path`` (an existing directory;
    ``memory://`` only with ``start_uploader=False``, in-process tests); restore falls back
    to it, and (with ``start_uploader``) one low-priority uploader process per tier-1 root
    copies every ``upload_every``-th committed step there. ``tier2_keep_last``/``tier2_keep_every``:
    tier-2 retention (newest K2, plus every M-th step forever; 0 = none).
    ``upload_drain_s``: on ``close()``, give the uploader up to this long to copy what is
    still due — the final checkpoints are the ones evaluation and serving want — and warn
    naming what was left (0: stop it at once; it resumes from its records next time).
    ``upload_backlog``: at most this many not-yet-uploaded checkpoints are held on tier 1
    beyond ``keep_last``; past that the oldest is released with an ``upload_skipped``
    event, so a tier 2 that is down never fills the disk (None: hold all).
    ``tier2_required``: a failing tier 2 (its newest upload failed, or the uploader keeps
    dying) is a :class:`SaveError` at ``save()`` per ``on_save_error``; by default it is a
    ``tier2_unhealthy`` event and a rate-limited warning.
    ``tier2_timeout_s``: how long the start-up probe and ``restore()`` wait for tier 2 to
    answer (probe, open, list, read a manifest) before going on with tier 1 alone.
    ``interval``: when :meth:`~tierckpt.CheckpointManager.should_save` says to save:
    :class:`~tierckpt.policy.interval.Every` (steps or seconds) or
    :class:`~tierckpt.policy.interval.AutoInterval` (``"auto"``: Young/Daly from this run's
    measured C, W, R and failures); None: the loop decides itself.
    ``tier2_require_conditional_writes``: refuse a tier 2 that ignores ``If-None-Match``
    (by default its markers are written and read back; see ``tierckpt doctor``).
    ``tier0``: keep checkpoints in node RAM (a tmpfs directory that outlives a worker
    restart; docs/tier0.md): a path, ``"auto"`` (``/dev/shm/tierckpt/<job key>``, and run
    without tier 0 when it does not fit) or None (off). With tier 0 every ``save()`` lands
    there; every ``tier1_every``-th is also copied to tier 1 in the background;
    ``tier0_keep`` generations stay in RAM; ``tier0_replicate`` sends each node's newest
    to a partner node (at most ``tier0_bandwidth`` bytes/s, None: unbounded), so a
    replaced node restores from the partner's RAM.
    ``staging``: ``"overlap"`` (default) copies parameters and optimizer state to host
    memory while the next forward/backward runs, and ``optimizer.step()`` waits for the copy
    (a step pre-hook), so ``save()`` blocks only for buffers and small state. It relies on
    one rule: between ``save()`` and the next ``optimizer.step()`` nothing else writes the
    parameters or the optimizer state in place (an in-place write that torch's version
    counter sees fails that save with a clear error; writes through ``.data`` are not seen).
    ``"sync"`` copies everything before ``save()`` returns. Without an optimizer in the
    ``TrainState`` staging is always synchronous.
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
    max_consecutive_save_failures: int = 3
    tier2: str | None = None
    upload_every: int = 1
    tier2_keep_last: int = 3
    tier2_keep_every: int = 0
    start_uploader: bool = True
    upload_drain_s: float = 600.0
    tier2_timeout_s: float = 60.0
    upload_backlog: int | None = 2
    tier2_required: bool = False
    tier2_require_conditional_writes: bool = False
    interval: Every | AutoInterval | str | None = None
    tier0: Path | str | None = None
    tier0_keep: int = 1
    tier1_every: int = 1
    tier0_replicate: bool = True
    tier0_bandwidth: float | None = None
    staging: str = "overlap"

    @property
    def tier0_auto(self) -> bool:
        """``tier0="auto"``: the default location, and no tier 0 when it does not fit."""
        return self.tier0 == "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.tier1, str | os.PathLike):
            raise ConfigError(f"tier1 must be a path, got {type(self.tier1).__name__}")
        raw = os.fspath(self.tier1)
        if isinstance(raw, str) and not raw.strip():
            raise ConfigError(f"tier1 is empty ({raw!r}), which would mean the current "
                              "directory; give the directory for checkpoints, e.g. "
                              "tier1='/local/ckpt'")
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
        check_count("max_consecutive_save_failures", self.max_consecutive_save_failures)
        if self.interval == "auto":
            object.__setattr__(self, "interval", AutoInterval())
        if self.interval is not None and not isinstance(self.interval, Every | AutoInterval):
            raise ConfigError(f"interval must be tierckpt.Every(steps=...|seconds=...), "
                              f"tierckpt.AutoInterval(...) or 'auto', got {self.interval!r}")
        if self.tier0 is not None and self.tier0 != "auto":
            if not isinstance(self.tier0, str | os.PathLike) or not os.fspath(self.tier0):
                raise ConfigError(f"tier0 must be a directory on tmpfs, 'auto' or None, got "
                                  f"{self.tier0!r}")
            object.__setattr__(self, "tier0", Path(self.tier0).expanduser().absolute())
        if self.staging not in STAGING_MODES:
            raise ConfigError(f"staging must be one of {list(STAGING_MODES)}, got "
                              f"{self.staging!r}")
        check_count("tier0_keep", self.tier0_keep)
        check_count("tier1_every", self.tier1_every)
        bw = self.tier0_bandwidth
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, int | float)
                               or not 0 < bw < float("inf")):
            raise ConfigError(f"tier0_bandwidth must be bytes per second > 0 (e.g. 500e6) "
                              f"or None, got {bw!r}")
        for name in ("fsync", "direct_io", "start_uploader", "tier2_required",
                     "tier2_require_conditional_writes", "tier0_replicate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.background_nice, bool) or not isinstance(self.background_nice, int) \
                or not 0 <= self.background_nice <= 19:
            raise ConfigError(f"background_nice must be an int in [0, 19], got "
                              f"{self.background_nice!r}")
        if self.tier2 is not None:
            _check_tier2(self.tier2, start_uploader=self.start_uploader)
        check_seconds("upload_drain_s", self.upload_drain_s, allow_zero=True)
        for name in ("collective_timeout_s", "wait_timeout_s", "tier2_timeout_s"):
            check_seconds(name, getattr(self, name))
        for name in ("file_mode", "dir_mode"):
            mode = getattr(self, name)
            if isinstance(mode, bool) or not isinstance(mode, int) or mode & 0o002:
                raise ConfigError(f"{name} must be an int mode that is not world-writable, "
                                  f"got {mode!r}")

    @property
    def retention(self) -> RetentionPolicy:
        """What each tier keeps (``keep_last``, ``upload_every``, ``tier2_keep_*``)."""
        return RetentionPolicy(keep_last=self.keep_last, upload_every=self.upload_every,
                               tier2_keep_last=self.tier2_keep_last,
                               tier2_keep_every=self.tier2_keep_every,
                               upload_backlog=self.upload_backlog)


def _check_tier2(url: str, *, start_uploader: bool) -> None:
    """``tier2`` as :func:`~tierckpt.tier2.storage.url.parse_url` accepts it (the rules
    ``open_storage`` applies later), and not ``memory://`` for a job with an uploader."""
    if parse_url(url, name="tier2").scheme == "memory" and start_uploader:
        raise ConfigError(
            f"tier2={url!r}: memory:// is an in-process store for tests only; the uploader "
            "runs in a child process, so its uploads would go nowhere anyone can read. Give "
            "s3://bucket/prefix or file:///absolute/path, or pass start_uploader=False in an "
            "in-process test")
