"""How a save writes (:class:`Writes`) and what the job does when one fails
(:class:`Failures`): two small frozen configs that :class:`tierckpt.ManagerConfig`
composes. Each validates itself on construction; the saver, the writer and the in-flight
tracker each receive only the one they read."""

from __future__ import annotations

import dataclasses
import enum

from tierckpt.errors import ConfigError
from tierckpt.policy.checks import check_bool, check_enum, check_mode
from tierckpt.policy.units import check_count, check_seconds


class Staging(str, enum.Enum):
    """How ``save()`` copies the state to host memory.

    ``OVERLAP`` (default): buffers and small state before ``save()`` returns; parameters and
    optimizer state during the next forward/backward, and ``optimizer.step()`` waits for
    that copy (a step pre-hook). It relies on one rule: between ``save()`` and the next
    ``optimizer.step()`` nothing else writes the parameters or the optimizer state in place
    (an in-place write that torch's version counter sees fails that save with a clear error;
    writes through ``.data`` are not seen). ``SYNC``: everything before ``save()`` returns.
    Without an optimizer in the ``TrainState`` staging is always synchronous.
    """

    OVERLAP = "overlap"
    SYNC = "sync"


class OnSaveError(str, enum.Enum):
    """What the next ``save()`` does when the previous background save failed.

    ``RAISE`` (default): raise :class:`SaveError` on every rank. ``CONTINUE``: log the error
    (``save_failed`` event and the ``tierckpt`` logger) and go on with the new save; the
    previous complete checkpoint stays the one a restart resumes from. ``wait()`` and
    ``close()`` always raise.
    """

    RAISE = "raise"
    CONTINUE = "continue"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Writes:
    """How every rank stages and writes its shards (tier 0 and tier 1 alike)."""

    staging: Staging = Staging.OVERLAP
    """See :class:`Staging`; ``"overlap"``/``"sync"`` are accepted too."""
    threads: int = 1
    """Files written in parallel per rank."""
    direct_io: bool = True
    """Write shards with O_DIRECT (falls back to buffered I/O where the file system refuses)."""
    fsync: bool = True
    """fsync files and directories. Off voids the durability promise: for throughput tests."""
    background_nice: int = 10
    """Niceness added to the background writer threads (Linux), so a save yields the CPU to
    training; 0 keeps them at the training thread's priority."""
    file_mode: int = 0o640
    """Permissions of created files (never world-writable)."""
    dir_mode: int = 0o750
    """Permissions of created directories (never world-writable)."""
    incremental: bool = False
    """Save frozen parameters once (tier 1; docs/staging.md, "Incremental saves"): each rank
    writes its frozen parameters (``requires_grad=False``) in a file of their own; a save
    in which none of them changed — same storage, same autograd version counter — neither
    copies them to host memory nor writes them again: the step hard-links the previous
    step's file. Off by default: a write through ``.data`` (``p.data.mul_(...)``, e.g. an
    EMA teacher) bypasses the version counter and would go unseen until the next full
    save."""
    full_every: int = 10
    """With ``incremental``: every ``full_every``-th save writes the frozen file afresh, so
    at most that many steps share one (a damaged copy is caught by every restore's CRC32C;
    tier 2 holds the content separately)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "staging", check_enum("Writes.staging", Staging, self.staging))
        check_count("Writes.threads", self.threads)
        check_bool("Writes.direct_io", self.direct_io)
        check_bool("Writes.fsync", self.fsync)
        nice = self.background_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ConfigError(f"Writes.background_nice must be an int in [0, 19], got {nice!r}")
        check_mode("Writes.file_mode", self.file_mode)
        check_mode("Writes.dir_mode", self.dir_mode)
        check_bool("Writes.incremental", self.incremental)
        check_count("Writes.full_every", self.full_every)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failures:
    """What a failed or stuck save, or a dead peer, does to the job."""

    on_save_error: OnSaveError = OnSaveError.RAISE
    """See :class:`OnSaveError`; ``"raise"``/``"continue"`` are accepted too."""
    max_consecutive: int = 3
    """With ``"continue"``, this many failed saves in a row raise anyway (a run that cannot
    checkpoint should not train on for days)."""
    wait_timeout_s: float = 3600.0
    """How long ``save()``/``wait()`` wait for a previous save to finish."""
    collective_timeout_s: float = 300.0
    """How long a background save or a restore waits for other ranks before failing (a dead
    peer is reported in this time, not torch's 30-minute default)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_save_error",
                           check_enum("Failures.on_save_error", OnSaveError, self.on_save_error))
        check_count("Failures.max_consecutive", self.max_consecutive)
        check_seconds("Failures.wait_timeout_s", self.wait_timeout_s)
        check_seconds("Failures.collective_timeout_s", self.collective_timeout_s)
