"""Repair of one tier-2 checkpoint from tier 1 (``tierckpt verify STEP --tier 2 --repair``).

A damaged or missing tier-2 object (bit rot on a file-system tier 2, an object removed by
hand) breaks the step that names it and, on a content-addressed tier 2, every later step
that names the same object: the uploader skips an object whose size and CRC32C the store
reports as matching (:mod:`tierckpt.tier2.uploader.content`), so it never sends it again by
itself, and a restore skips those steps.

:func:`repair_tier2` checks every object of the step as :func:`~tierckpt.ops.check.
check_tier2` does and sends each bad one again from a tier-1 copy whose bytes verify: the
step's own file on the given root, else a file of the same name, size and CRC32C in another
of the root's committed steps (a frozen file that incremental saves link into every step) —
content-addressed, only one whose SHA-256 is the object's name. The store checks the bytes
end to end on the PUT (an atomic replace), and the object is then read back and checked
again. A repaired content object repairs every step that names it.

Guarantees: nothing is deleted and no marker or manifest is written; a file with no good
tier-1 copy is reported and left as it was. Files of other nodes' ranks are repaired by
running the command on those nodes (each node's tier 1 holds its own shards).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError, IntegrityError, StorageError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.ops.check import check_object, sha256_of
from tierckpt.tier2.catalog import Resolved, Tier2Catalog
from tierckpt.tier2.storage import ObjectNotFoundError, Storage
from tierckpt.tier2.storage.base import Progress, ProgressTally


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepairReport:
    """What a repair found and did. ``repaired``: (file, the tier-1 copy sent); ``left``:
    (file, why it is still bad); ``ok``: every file of the step verifies now."""

    step: int
    location: str
    files: int = 0
    repaired: tuple[tuple[str, str], ...] = ()
    left: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.left

    def to_json(self) -> dict[str, Any]:
        return {"tier": 2, "step": self.step, "location": self.location, "ok": self.ok,
                "files": self.files, "seconds": self.seconds, "error": self.error,
                "repaired": [{"file": f, "from": src} for f, src in self.repaired],
                "left": [{"file": f, "why": why} for f, why in self.left]}


def _copies(root: Path, step: int, f: mf.FileEntry) -> Iterator[Path]:
    """``root``'s files that may hold ``f``'s bytes: the step's own, then the same name in
    the root's other committed steps, newest first."""
    own = root / layout.step_dirname(step) / f.name
    yield own
    steps = sorted((s for d in root.iterdir() if (s := layout.parse_step_dirname(d.name))
                    is not None and s != step), reverse=True)
    for s in steps:
        d = root / layout.step_dirname(s)
        if (d / layout.COMPLETE).is_file():
            yield d / f.name


def _good_copy(root: Path, step: int, f: mf.FileEntry, key: str,
               addressed: bool) -> Path | None:
    """The first of :func:`_copies` whose size, CRC32C and (``addressed``) SHA-256 match."""
    for path in _copies(root, step, f):
        try:
            if path.stat().st_size != f.size or checksum.of_file(path)[0] != f.crc32c:
                continue
            if addressed and sha256_of(path) != key.rsplit("/", 1)[-1]:
                continue
        except OSError:
            continue
        return path
    return None


def repair_object(storage: Storage, where: Resolved, f: mf.FileEntry, root: Path,
                  scratch: Path) -> tuple[str | None, str]:
    """Send ``f`` again from a good tier-1 copy: (the copy sent, "") when it verifies on
    tier 2 after, else (None, why)."""
    key = where.key(f.name)
    step = where.committed.manifest.step
    source = _good_copy(root, step, f, key, where.objmap is not None)
    if source is None:
        if not (root / layout.step_dirname(step) / f.name).exists():
            return None, (f"{root} does not hold it: run this where the tier 1 that holds "
                          "it is (each node's tier 1 holds its own ranks' files)")
        return None, f"no copy of it on {root} matches the manifest"
    try:
        storage.put_file(key, source, crc32c=f.crc32c, size=f.size)
    except (IntegrityError, StorageError) as e:
        return None, f"sending {source} again failed: {e}"
    still = check_object(storage, where, f, scratch)
    return (str(source), "") if still is None else (None, f"still bad after sending "
                                                          f"{source} again: {still}")


def repair_tier2(storage: Storage, step: int, tier1: Path, *, parallel: int = 4,
                 progress: Progress | None = None) -> RepairReport:
    """Check every object of tier 2's ``step`` (``parallel`` at a time; ``progress`` hears
    the bytes checked after each) and send the bad ones again from ``tier1`` (the module
    docstring). ConfigError for a ``tier1`` that is not a directory or ``parallel`` < 1."""
    tier1 = Path(tier1)
    if not tier1.is_dir():
        raise ConfigError(f"--tier1 {str(tier1)!r} is not a directory: give the tier-1 root "
                          "that holds this node's copy of the step")
    if parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {parallel}")
    location = f"{storage.url}/{layout.step_dirname(step)}"
    t0 = time.monotonic()
    try:
        where = Tier2Catalog(storage).resolve(step)
    except ObjectNotFoundError:
        return RepairReport(step=step, location=location,
                            error=f"no complete {layout.step_dirname(step)} on tier 2: "
                                  "nothing to repair (upload it again: tierckpt upload)")
    except (IntegrityError, StorageError) as e:
        return RepairReport(step=step, location=location, error=str(e))
    m = where.committed.manifest
    tally = ProgressTally(m.total_bytes, progress)
    repaired: list[tuple[str, str]] = []
    left: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="tierckpt-repair-") as tmp, \
            ThreadPoolExecutor(parallel, thread_name_prefix="tierckpt-repair") as pool:
        def check(f: mf.FileEntry) -> tuple[mf.FileEntry, str | None]:
            bad = check_object(storage, where, f, Path(tmp))  # names are unique in a step
            tally.add(f.size)
            return f, bad
        for f, bad in list(pool.map(check, m.files)):
            if bad is None:
                continue
            source, why = repair_object(storage, where, f, tier1, Path(tmp))
            if source is not None:
                repaired.append((f.name, source))
            else:
                left.append((f.name, f"{bad}; {why}"))
    return RepairReport(step=step, location=location, files=len(m.files),
                        repaired=tuple(repaired), left=tuple(left),
                        seconds=time.monotonic() - t0)
