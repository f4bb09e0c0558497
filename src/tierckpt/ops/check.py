"""Full verification of one checkpoint on one tier: every byte against its CRC32C.

:func:`check_tier1` reads every file of a tier-1 checkpoint this root holds;
:func:`check_tier2` downloads every object of a tier-2 checkpoint (verified by the storage
backend against the manifest's CRC32C as it arrives, and, for a content-addressed step, its
SHA-256 against the object's name) into a scratch directory that is removed afterwards.
Both verify the COMPLETE marker against ``manifest.json`` first and return a
:class:`CheckReport` instead of raising for damage, so a caller can render it; only bad
input (a missing root, a bad step) raises :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierckpt.errors import (
    ConfigError,
    IntegrityError,
    MissingFilesError,
    SignatureError,
    StorageError,
)
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.restore.verify import verify_checkpoint
from tierckpt.tier1.manifests import read_committed, read_small, rebuild_manifest
from tierckpt.tier2.catalog import Resolved, Tier2Catalog
from tierckpt.tier2.storage import ObjectNotFoundError, Storage
from tierckpt.tier2.storage.base import Progress, ProgressTally


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckReport:
    """Outcome of a full check. ``ok`` is False when any byte, size, marker or required
    file is wrong; ``error`` then names the file and the reason. ``elsewhere`` lists files
    of a node-local tier 1 that other nodes hold (not damage: ``ok`` stays True)."""

    tier: int
    step: int
    location: str
    ok: bool
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    elsewhere: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "step": self.step, "location": self.location, "ok": self.ok,
                "files": self.files, "bytes": self.bytes, "seconds": self.seconds,
                "error": self.error, "elsewhere": list(self.elsewhere)}


def _check_step(step: int) -> None:
    if step < 0:
        raise ConfigError(f"STEP must be >= 0, got {step}")


def _unverified(d: Path, step: int, e: Exception) -> str:
    """Why ``d``'s marker and manifest do not verify, saying when the manifest parts
    rebuild the manifest (restorable, yet a damaged file on disk)."""
    try:
        rebuilt = rebuild_manifest(d, read_small(d / layout.COMPLETE), step=step)
    except (IntegrityError, OSError):
        rebuilt = None
    if rebuilt is None:
        return str(e)
    return (f"{e}; its manifest parts rebuild the manifest the marker vouches for, so a "
            "restore loses nothing, but the file on disk is damaged")


def check_tier1(root: Path, step: int) -> CheckReport:
    """Verify marker, manifest, sizes and the CRC32C of every file of ``root``'s checkpoint
    of ``step`` (reads every byte once)."""
    _check_step(step)
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"tier-1 root {str(root)!r} is not a directory")
    d = root / layout.step_dirname(step)
    t0 = time.monotonic()
    report = functools.partial(CheckReport, tier=1, step=step, location=str(d))
    if not os.path.lexists(d):
        return report(ok=False, error=f"no checkpoint {d.name} in {root}")
    elsewhere: tuple[str, ...] = ()
    try:
        read_committed(d, step=step, rebuild=False)
    except SignatureError as e:
        return report(ok=False, seconds=time.monotonic() - t0, error=str(e))
    except (IntegrityError, OSError) as e:
        return report(ok=False, seconds=time.monotonic() - t0, error=_unverified(d, step, e))
    try:
        m = verify_checkpoint(d, step=step, full=True)
    except MissingFilesError as e:  # every file present passed; the rest is on other nodes
        elsewhere = tuple(e.missing)
        m = read_committed(d, step=step).manifest
    except (IntegrityError, OSError) as e:
        return report(ok=False, seconds=time.monotonic() - t0, error=str(e))
    held = [f for f in m.files if f.name not in elsewhere]
    return report(ok=True, files=len(held), bytes=sum(f.size for f in held),
                       seconds=time.monotonic() - t0, elsewhere=elsewhere)


def sha256_of(path: Path) -> str:
    """The SHA-256 hex digest of the file at ``path``."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_object(storage: Storage, where: Resolved, f: mf.FileEntry,
                 scratch: Path) -> str | None:
    """Download member ``f`` of the resolved tier-2 step ``where`` into ``scratch`` (removed
    after) and check its CRC32C, size and, content-addressed, its SHA-256 against its
    object's name: None when it verifies, else why not (naming the file)."""
    dest = scratch / f.name
    key = where.key(f.name)
    try:
        info = storage.get_file(key, dest, crc32c=f.crc32c)
        if where.objmap is not None and sha256_of(dest) != key.rsplit("/", 1)[-1]:
            return f"{f.name}: its bytes do not hash to their object's name {key}"
    except ObjectNotFoundError:
        return f"{f.name} is missing on tier 2 ({key})"
    except (IntegrityError, StorageError) as e:
        return f"{f.name}: {e}"
    finally:
        dest.unlink(missing_ok=True)
    if info.size != f.size:
        return f"{f.name} has {info.size} bytes on tier 2, manifest says {f.size}"
    return None


def check_tier2(storage: Storage, step: int, *, parallel: int = 4,
                scratch: Path | None = None, progress: Progress | None = None) -> CheckReport:
    """Verify tier 2's checkpoint of ``step``: marker against manifest, then download every
    object and check its size and CRC32C. ``scratch`` (default: the system temp directory)
    must hold the largest ``parallel`` objects at once; nothing is left there. ``progress``
    hears the bytes checked after each object."""
    _check_step(step)
    if parallel < 1:
        raise ConfigError(f"parallel must be >= 1, got {parallel}")
    report = functools.partial(CheckReport, tier=2, step=step,
                               location=f"{storage.url}/{layout.step_dirname(step)}")
    t0 = time.monotonic()
    try:
        where = Tier2Catalog(storage).resolve(step)
        m = where.committed.manifest
    except ObjectNotFoundError:
        return report(ok=False, error=f"no complete {layout.step_dirname(step)} "
                           "on tier 2 (COMPLETE or manifest.json missing)")
    except (IntegrityError, StorageError) as e:
        return report(ok=False, error=str(e))

    with tempfile.TemporaryDirectory(prefix="tierckpt-verify-", dir=scratch) as tmp, \
            ThreadPoolExecutor(parallel, thread_name_prefix="tierckpt-verify") as pool:
        tally = ProgressTally(m.total_bytes, progress)

        def check(f: mf.FileEntry) -> str | None:
            why = check_object(storage, where, f, Path(tmp))
            tally.add(f.size)
            return why
        errors = [e for e in pool.map(check, m.files) if e is not None]
    seconds = time.monotonic() - t0
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return report(ok=False, seconds=seconds, error=errors[0] + more)
    return report(ok=True, files=len(m.files), bytes=m.total_bytes,
                       seconds=seconds)
