"""Deleting content objects no step needs, safely against kills and uploads in flight.

Only :class:`~tierckpt.tier2.catalog.Tier2Catalog` calls this module (the catalogue stays
the one place that deletes from tier 2). A step is deleted marker first, then its own
objects under ``step-XXXXXXXX/``; then :func:`sweep` removes the content objects
(``objects/sha256/…``) that nothing references. *Referenced* means: listed by the map
(``objects.json``) of a step that has a ``COMPLETE`` object, or by any uploader's map part
(``objects.<tag>.json``, an intent: the upload in flight that wrote it may skip those objects
because they are there). A kill at any point therefore never removes an object a complete
step needs: its marker and map are present until the step itself is being deleted, and
content goes only after a fresh listing shows nothing references it. A map that cannot be
read blocks the sweep (nothing is deleted) rather than be guessed at.

The race with an upload in flight, and how it is closed (a lease, not a guess at ages):
an uploader that skips object X because it is there relies on X until its marker lands.
A sweep that listed the maps *before* that uploader wrote its part does not see the
intent and may delete X. So:

1. a sweep first writes a lease ``objects/sweeps/<id>.json`` (create-only), then lists the
   content objects, then the steps and maps (content first: an object uploaded after that
   listing is never a candidate), and issues deletions only within ``window_s`` seconds of
   its own clock from before the lease; it removes the lease when done;
2. an uploader writes its part before any skip decision; before its manifest it waits
   until no lease is listed (:func:`await_sweeps`; a lease it has seen for more than twice
   the window is expired — that sweep stopped deleting long ago — and is removed, as is at
   once a lease whose holder, a process of this machine's boot and PID namespace, is no
   longer running: the lease names it, :mod:`tierckpt._holder`), then
   HEADs every object it skipped again and uploads the ones that went missing.

A sweep that could miss the part leased before the part was written, so its deletions end
before the uploader's re-check; a sweep that leased later lists the part. No clocks are
compared across machines; each side measures its own elapsed time. Cost in the common case:
one LIST of the lease prefix per upload.

Sibling runs sharing a prefix (``?run=NAME``, :mod:`tierckpt.tier2.storage.runs`) follow the
same rule across runs: a sweep reads the maps and parts of every run under the prefix (the
prefix's own steps and ``runs/*/``), not only those of the run that deletes; the leases are
the prefix's, so every run's uploads and sweeps see each other's; and a run's retention
deletes its own steps only (its catalogue lists nothing else).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Mapping

from tierckpt import _holder
from tierckpt.errors import IntegrityError, SignatureError, StorageError
from tierckpt.format import layout, objmap
from tierckpt.format import manifest as mf
from tierckpt.tier1.manifests import MANIFEST_LIMIT
from tierckpt.tier2.storage import Storage
from tierckpt.tier2.storage.runs import RUNS, RunStorage

SWEEP_WINDOW_S = 30.0
"""A sweep issues deletions only this long after its lease; an uploader treats a lease it
has seen for twice this long as expired."""


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """``deleted`` content objects and their ``bytes``; ``blocked`` says why nothing was
    deleted (None: not blocked); ``unfinished``: the window ended first (the next sweep
    goes on)."""

    deleted: int = 0
    bytes: int = 0
    blocked: str | None = None
    unfinished: bool = False


def read_map(storage: Storage, key: str) -> objmap.ObjectMap:
    """The map or part at ``key``, its own digest checked (size bounded like a manifest)."""
    data = storage.get_bytes(key)
    if len(data) > MANIFEST_LIMIT:
        raise IntegrityError(f"tier-2 {key} is larger than {MANIFEST_LIMIT} bytes")
    return objmap.ObjectMap.from_bytes(data)


def references(storage: Storage, steps: Mapping[int, Mapping[str, int]],
               prefix: str = "") -> set[str]:
    """Content keys referenced (module docstring) by the steps of one listing
    (step → {member: size}) under ``prefix``. Raises when a map or part cannot be read."""
    refs: set[str] = set()
    for step, members in steps.items():
        names = [n for n in members if objmap.is_part(n)]
        if layout.COMPLETE in members and objmap.MAP in members:
            names.append(objmap.MAP)
        for name in names:
            refs.update(read_map(storage, f"{prefix}{layout.step_dirname(step)}/{name}")
                        .keys().values())
    return refs


def sibling_references(storage: Storage) -> set[str]:
    """Content keys referenced by the other runs sharing ``storage``'s prefix: the
    prefix's own steps and every ``runs/<name>/`` but the one ``storage`` is (when it is a
    :class:`~tierckpt.tier2.storage.runs.RunStorage`)."""
    base, own = (storage.shared, f"{RUNS}{storage.run}/") if isinstance(storage, RunStorage) \
        else (storage, "")
    by_run: dict[str, dict[int, dict[str, int]]] = {}
    for info in (*base.list("step-"), *base.list(RUNS)):
        parts = info.key.split("/", 3)
        run = f"{RUNS}{parts[1]}/" if parts[0] == RUNS[:-1] and len(parts) == 4 else ""
        head, member = parts[2:4] if run else (parts[0], "/".join(parts[1:]))
        step = layout.parse_step_dirname(head)
        if step is not None and member and run != own:
            by_run.setdefault(run, {}).setdefault(step, {})[member] = info.size
    return set().union(*(references(base, steps, run) for run, steps in by_run.items()))


def sweep(storage: Storage, list_steps: Callable[[], Mapping[int, Mapping[str, int]]], *,
          window_s: float = SWEEP_WINDOW_S) -> SweepResult:
    """Delete the unreferenced content objects (module docstring: lease, content listing,
    maps, deletions within the window, lease removed). ``list_steps`` is the catalogue's
    one listing of the step prefixes."""
    t0 = time.monotonic()
    lease = f"{objmap.SWEEPS}{uuid.uuid4().hex}.json"
    storage.put_bytes(lease, mf.canonical({"window_s": window_s, "holder": _holder.me()}),
                      if_none_match=True)
    content = {i.key: i.size for i in storage.list(objmap.OBJECTS)}
    try:
        refs = references(storage, list_steps()) | sibling_references(storage) \
            if content else set()
    except (IntegrityError, SignatureError, StorageError) as e:
        storage.delete(lease)
        return SweepResult(blocked=f"a map could not be read, nothing deleted: {e}")
    deleted = size = 0
    for key in sorted(set(content) - refs):
        if time.monotonic() - t0 >= window_s:
            storage.delete(lease)
            return SweepResult(deleted, size, unfinished=True)
        storage.delete(key)
        deleted, size = deleted + 1, size + content[key]
    storage.delete(lease)
    return SweepResult(deleted, size)


def await_sweeps(storage: Storage, *, window_s: float = SWEEP_WINDOW_S,
                 sleep: Callable[[float], object] = time.sleep) -> None:
    """Return once no sweep that could have missed an intent written before this call is
    still deleting: no lease listed, or every listed lease seen here for more than twice
    its window (then expired: removed). A lease's window is the one it declares when that is
    shorter than ``window_s`` (its sweep deletes only that long: a sweep killed after a short
    lease holds uploads back that much less), else ``window_s``. A lease whose holder was a
    process on this machine that no longer runs (:func:`tierckpt._holder.gone`: a sweep
    killed, e.g. with its job) is expired at once."""
    first_seen: dict[str, float] = {}
    windows: dict[str, float] = {}
    while True:
        leases = [i.key for i in storage.list(objmap.SWEEPS)]
        now = time.monotonic()
        live = []
        for key in leases:
            if key not in windows:
                declared, dead = _read_lease(storage, key, window_s)
                windows[key] = -1.0 if dead else min(window_s, declared)  # dead: expired
            if now - first_seen.setdefault(key, now) > 2 * windows[key]:
                storage.delete(key)
            else:
                live.append(key)
        if not live:
            return
        sleep(min(0.5, min(windows[k] for k in live) / 10))


def _read_lease(storage: Storage, key: str, default: float) -> tuple[float, bool]:
    """The ``window_s`` a lease declares (``default`` when it cannot be read or is no
    positive number: gone meanwhile, damaged, written by hand), and whether its holder is
    known to be dead (:func:`tierckpt._holder.gone`: a sweep killed on this machine)."""
    try:
        lease = json.loads(storage.get_bytes(key))
        window, holder = lease.get("window_s"), lease.get("holder")
    except (StorageError, ValueError, AttributeError):
        return default, False
    ok = isinstance(window, (int, float)) and not isinstance(window, bool) and window > 0
    dead = isinstance(holder, dict) and _holder.gone(holder)
    return (float(window) if ok else default), dead
