"""A scrub of all of tier 2 (``tierckpt verify --all --tier 2``): every complete step's
marker and map, and every object they name read once, however many steps share it.

For a periodic check of a tier 2 that can rot at rest (a file-system tier 2): a content
object shared by many steps (frozen weights) is downloaded once, and a damaged one names
every step it breaks. With a tier-1 root (``--repair --tier1 DIR``) each bad object is sent
again from a copy there that verifies (:func:`tierckpt.ops.repair.repair_object`), which
mends every step that names it. Nothing is deleted and no marker is written.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError, IntegrityError, StorageError
from tierckpt.format import manifest as mf
from tierckpt.ops.check import check_object
from tierckpt.ops.repair import repair_object
from tierckpt.tier2.catalog import Resolved, Tier2Catalog
from tierckpt.tier2.storage import ObjectNotFoundError, Storage
from tierckpt.tier2.storage.base import Progress, ProgressTally

Naming = tuple[int, Resolved, mf.FileEntry]
"""A step, its resolved map and the member whose bytes an object holds."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScrubReport:
    """What a scrub read and found. ``bad``: (step, why) of each complete step that does not
    verify (still, after any repair); ``repaired``: (object key, the tier-1 copy sent)."""

    location: str
    steps: tuple[int, ...] = ()
    objects: int = 0
    bytes: int = 0
    bad: tuple[tuple[int, str], ...] = ()
    repaired: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_json(self) -> dict[str, Any]:
        return {"tier": 2, "location": self.location, "ok": self.ok,
                "steps": list(self.steps), "objects": self.objects, "bytes": self.bytes,
                "seconds": self.seconds,
                "bad": [{"step": s, "why": why} for s, why in self.bad],
                "repaired": [{"object": k, "from": src} for k, src in self.repaired]}


def _named(catalog: Tier2Catalog, steps: list[int]
           ) -> tuple[dict[str, list[Naming]], dict[int, str]]:
    """Each object key → the (step, map, member) naming it; and the steps whose marker,
    manifest or map do not verify → why."""
    by_key: dict[str, list[Naming]] = {}
    broken: dict[int, str] = {}
    for step in steps:
        try:
            where = catalog.resolve(step)
        except ObjectNotFoundError as e:
            broken[step] = f"gone while scrubbing, or its manifest is missing: {e}"
            continue
        except (IntegrityError, StorageError) as e:
            broken[step] = str(e)
            continue
        for f in where.committed.manifest.files:
            by_key.setdefault(where.key(f.name), []).append((step, where, f))
    return by_key, broken


def scrub_tier2(storage: Storage, *, tier1: Path | None = None, parallel: int = 4,
                progress: Progress | None = None) -> ScrubReport:
    """Check every complete step of tier 2, each object once (``parallel`` at a time); with
    ``tier1``, send each bad object again from there (the module docstring). ``progress``
    hears the bytes checked after each object."""
    if parallel < 1:
        raise ConfigError(f"parallel must be >= 1, got {parallel}")
    if tier1 is not None and not Path(tier1).is_dir():
        raise ConfigError(f"--tier1 {str(tier1)!r} is not a directory: give the tier-1 root "
                          "that holds this node's copies")
    t0 = time.monotonic()
    catalog = Tier2Catalog(storage)
    steps = catalog.complete_steps()
    by_key, broken = _named(catalog, steps)
    repaired: list[tuple[str, str]] = []
    tally = ProgressTally(sum(n[0][2].size for n in by_key.values()), progress)
    with tempfile.TemporaryDirectory(prefix="tierckpt-scrub-") as tmp, \
            ThreadPoolExecutor(parallel, thread_name_prefix="tierckpt-scrub") as pool:
        def check(key: str) -> tuple[str, str | None]:
            _, where, f = by_key[key][0]
            why = check_object(storage, where, f, Path(tmp) / _slot(key))
            tally.add(f.size)
            return key, why
        failed = {k: why for k, why in pool.map(check, sorted(by_key)) if why is not None}
        for key in sorted(failed) if tier1 is not None else ():
            assert tier1 is not None
            source = _repair(storage, by_key[key], Path(tier1), Path(tmp) / _slot(key))
            if source is not None:
                repaired.append((key, source))
                del failed[key]
    for key, why in failed.items():
        for step, _, _ in by_key[key]:
            broken.setdefault(step, why)
    return ScrubReport(location=storage.url, steps=tuple(steps), objects=len(by_key),
                       bytes=tally.total,
                       bad=tuple(sorted(broken.items())), repaired=tuple(repaired),
                       seconds=time.monotonic() - t0)


def _repair(storage: Storage, naming: list[Naming], tier1: Path,
            scratch: Path) -> str | None:
    """Send an object again from the first tier-1 copy of a member naming it that
    verifies (the newest step's first): the copy sent, or None."""
    for _, where, f in sorted(naming, key=lambda n: -n[0]):
        source, _why = repair_object(storage, where, f, tier1, scratch)
        if source is not None:
            return source
    return None


def _slot(key: str) -> str:
    """A scratch subdirectory per object (two objects may hold members of one name, and
    run at once): the key, flattened."""
    return key.replace("/", "_")
