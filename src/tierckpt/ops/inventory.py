"""Every checkpoint on every tier, with its state: what ``tierckpt ls`` shows.

Tiers: 0 (node RAM: the job's tier-0 root, when it is visible from this node — the
``Tier0()`` default root derived from the tier-1 root, or a ``Tier0(path)`` named by the
caller), 1 (the tier-1 root) and 2 (a store).

Two layers, kept apart (STYLE habit 5):

- :func:`classify` is pure: from what was observed (:class:`Observed`, one per tier and
  checkpoint name), the recorded upload statuses and the pins, it derives each entry's
  state, size and age. Its tests need no files.
- :func:`observe_tier1` / :func:`observe_tier2` read a tier-1 root or a tier-2 store (two
  small objects per committed checkpoint plus a listing; shard bytes are never read), and
  :func:`inventory` composes them.

States (``Entry.state``)::

    partial        no COMPLETE marker: a save or upload in progress, or one that crashed
    invalid        a COMPLETE marker that does not vouch for manifest.json (detail: why)
    complete       tier 0: committed in node RAM (a ``peer/`` row: the partner node's
                   replica held here); tier 1: committed, not (yet) copied to tier 2
    uploading      tier 1: the uploader started copying it, or copied this node's files
                   and waits for other nodes
    upload_failed  tier 1: the uploader's last attempt failed (detail: the error); it
                   retries with back-off
    verified       tier 1: the uploader verified its tier-2 copy (which tier-2 retention
                   may since have deleted); tier 2: the marker is there, written only after
                   every object was verified
    conflict       tier 1: tier 2 holds a different checkpoint for this step

``Entry.pinned_by`` is orthogonal: the holders of ``pins/`` files (e.g. ``upload``), which
tier-1 retention never deletes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError, IntegrityError, StorageError
from tierckpt.format import layout, objmap
from tierckpt.tier0.root import JOB_FILE, PEER_DIR, default_root
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import ObjectNotFoundError, Storage

STATES = ("partial", "invalid", "complete", "uploading", "upload_failed", "verified",
          "conflict")
_UPLOAD_STATE = {"uploading": "uploading", "failed": "upload_failed",
                 "files_verified": "uploading", "verified": "verified",
                 "conflict": "conflict"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observed:
    """What was read about one checkpoint on one tier (no judgement yet).

    ``committed``: a COMPLETE marker exists. ``marker_error``: why it does not vouch for the
    manifest (None when it does, or when there is no marker). ``bytes``: bytes stored on
    this tier under the checkpoint's name. ``created_unix``: the manifest's creation time,
    else the directory's mtime, else None.
    """

    tier: int
    step: int
    name: str
    committed: bool
    bytes: int
    created_unix: float | None = None
    marker_error: str | None = None
    save_id: str | None = None
    uploaded: int | None = None
    """Content-addressed tier-2 steps: the bytes their upload sent (``bytes`` is what the
    step refers to, most of it maybe stored once for several steps); None elsewhere."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One row of ``tierckpt ls`` (``to_json`` is the ``--json`` schema of a row)."""

    tier: int
    step: int
    name: str
    state: str
    bytes: int
    age_s: float | None
    pinned_by: tuple[str, ...] = ()
    upload_status: str | None = None
    detail: str | None = None
    integrity: str | None = None
    """How the tier-2 copy was verified on upload (``crc32c`` or ``md5``), when this
    root's uploader recorded it."""
    uploaded: int | None = None
    """Bytes the tier-2 upload of a content-addressed step sent (``bytes``: referenced)."""

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "step": self.step, "name": self.name, "state": self.state,
                "bytes": self.bytes, "age_s": self.age_s, "pinned_by": list(self.pinned_by),
                "upload_status": self.upload_status, "detail": self.detail,
                "integrity": self.integrity, "uploaded_bytes": self.uploaded}


def classify(observed: Iterable[Observed], *, upload: Mapping[int, Mapping[str, Any]],
             pins: Mapping[int, Iterable[str]], now: float) -> list[Entry]:
    """Entries for ``observed``, newest step first, the nearest tier first (0, 1, 2).

    ``upload`` maps step → recorded upload state (``{"status": ..., "error": ...}``, as
    :meth:`tierckpt.tier1.catalog.Tier1Catalog.upload_records` returns); ``pins`` maps
    step → pin holders (tier 1 only); ``now`` is the reference time for ages (seconds since
    the epoch).
    """
    out = []
    for o in observed:
        integrity = (upload.get(o.step) or {}).get("integrity") if o.tier else None
        rec = upload.get(o.step) if o.tier == 1 else None
        status = str(rec.get("status")) if rec else None
        detail = None
        if not o.committed:
            state = "partial"
            detail = "no COMPLETE marker (in progress or crashed)"
        elif o.marker_error is not None:
            state, detail = "invalid", o.marker_error
        elif o.tier == 2:
            state = "verified"
        elif o.tier == 0:
            state = "complete"
            if o.name.startswith(f"{PEER_DIR}/"):
                detail = "the partner node's replica, held in this node's RAM"
        elif rec is not None and str(rec.get("save_id")) not in (str(o.save_id), "None"):
            state = "complete"  # the record is about an older checkpoint of the same step
            status = None
        else:
            state = _UPLOAD_STATE.get(status or "", "complete")
            if status in ("failed", "conflict") and rec is not None and rec.get("error"):
                detail = str(rec["error"])
            elif status == "files_verified":
                detail = "this node's files verified; waiting for other nodes"
        age = None if o.created_unix is None else max(0.0, now - o.created_unix)
        out.append(Entry(tier=o.tier, step=o.step, name=o.name, state=state, bytes=o.bytes,
                         uploaded=o.uploaded,
                         age_s=age, upload_status=status, detail=detail,
                         integrity=None if integrity is None else str(integrity),
                         pinned_by=tuple(sorted(pins.get(o.step, ()))) if o.tier == 1 else ()))
    return sorted(out, key=lambda e: (-e.step, e.tier, e.name))


# -- reading the tiers ------------------------------------------------------------------------
def _dir_bytes(path: str | os.PathLike[str]) -> int:
    total = 0
    for e in os.scandir(path):
        if e.is_file(follow_symlinks=False):
            total += e.stat(follow_symlinks=False).st_size
    return total


def observe_tier1(root: Path) -> list[Observed]:
    """Every final-named checkpoint directory and every in-progress (tmp) directory under
    ``root``. Raises :class:`ConfigError` when ``root`` is not a directory."""
    if not Path(root).is_dir():
        raise ConfigError(f"tier-1 root {str(root)!r} is not a directory")
    return _observe_dir(Path(root), tier=1)


def tier0_root(tier1: Path, tier0: Path | None = None) -> Path | None:
    """The tier-0 root of the job whose tier-1 root is ``tier1``, if this node can see it:
    ``tier0`` when given (a ``Tier0(path)`` job's directory), else the ``Tier0()`` default
    root derived from ``tier1`` (under ``$TIERCKPT_TIER0_BASE`` or ``/dev/shm/tierckpt``).
    None when that directory does not exist here (tier 0 off, another node's RAM, or
    emptied by a clean end). Read-only. Raises :class:`ConfigError` when its ``job.json``
    names another tier-1 root: that tier 0 belongs to another job."""
    tier1 = Path(tier1).expanduser().absolute()
    path = default_root(tier1) if tier0 is None else Path(tier0).expanduser().absolute()
    if not path.is_dir():
        if tier0 is not None:
            raise ConfigError(f"--tier0 {str(path)!r} is not a directory on this node; give "
                              "the job's Tier0(path) directory, or leave --tier0 out for a "
                              "Tier0() job")
        return None
    try:
        owner = json.loads((path / JOB_FILE).read_text()).get("tier1")
    except (OSError, ValueError, AttributeError):
        owner = None
    if owner != str(tier1):
        if tier0 is None:
            return None  # not this job's: never read (a leftover, or being created)
        raise ConfigError(f"tier-0 root {str(path)!r} belongs to another job (its {JOB_FILE} "
                          f"names tier1 {owner!r}, not {str(tier1)!r})")
    return path


def observe_tier0(root: Path) -> list[Observed]:
    """Every checkpoint in a tier-0 root (tier 0): this node's own, and the partner's
    replica under ``peer/`` (named ``peer/step-XXXXXXXX``)."""
    out = _observe_dir(root, tier=0)
    if (root / PEER_DIR).is_dir():
        out += _observe_dir(root / PEER_DIR, tier=0, prefix=f"{PEER_DIR}/")
    return out


def _observe_dir(root: Path, *, tier: int, prefix: str = "") -> list[Observed]:
    """Committed-name and in-progress checkpoint directories under ``root``, in the
    tier-1 layout (tier 0 has the same)."""
    cat = Tier1Catalog(root)
    out = [Observed(tier=tier, step=step, name=prefix + path.name, committed=False,
                    bytes=_dir_bytes(path), created_unix=path.lstat().st_mtime)
           for step, path in cat.in_progress()]
    for step in cat.candidate_steps():
        d = cat.step_dir(step)
        if not d.is_dir() or d.is_symlink():
            continue
        mtime = d.lstat().st_mtime
        committed = cat.has_marker(step)
        created, err, save_id = mtime, None, None
        if committed:
            try:
                m = cat.read_committed(step).manifest
                created, save_id = m.created_unix or mtime, m.save_id
            except (IntegrityError, OSError) as x:
                err = f"{type(x).__name__}: {x}"
        out.append(Observed(tier=tier, step=step, name=prefix + d.name, committed=committed,
                            bytes=_dir_bytes(d), created_unix=created, marker_error=err,
                            save_id=save_id))
    return out


def observe_tier2(storage: Storage) -> list[Observed]:
    """Every checkpoint prefix in ``storage``: committed ones have their marker checked
    against their manifest (and their object map read: three small reads each); sizes come
    from one listing. A content-addressed step's ``bytes`` are its files wherever they are
    stored plus its manifest and marker (what it refers to, as on tier 1), ``uploaded``
    what its upload sent."""
    cat = Tier2Catalog(storage)
    out = []
    for step, objects in cat.objects().items():
        committed = layout.COMPLETE in objects
        created, err, save_id, uploaded = None, None, None, None
        size = sum(objects.values())
        if committed:
            try:
                where = cat.resolve(step)
                m = where.committed.manifest
                created, save_id = m.created_unix or None, m.save_id
                if where.objmap is not None:
                    uploaded = where.objmap.uploaded
                    size = where.objmap.referenced + sum(
                        n for k, n in objects.items()
                        if k != objmap.MAP and not objmap.is_part(k))
            except ObjectNotFoundError:
                err = "COMPLETE present but manifest.json missing"
            except (IntegrityError, StorageError) as x:
                err = f"{type(x).__name__}: {x}"
        out.append(Observed(tier=2, step=step, name=layout.step_dirname(step),
                            committed=committed, bytes=size, created_unix=created,
                            marker_error=err, save_id=save_id, uploaded=uploaded))
    return out


def inventory(tier1: Path, storage: Storage | None = None, *, tier0: Path | None = None,
              now: float | None = None) -> list[Entry]:
    """Every checkpoint on tier 1, on tier 0 when its root is visible here
    (:func:`tier0_root`: ``tier0``, else the ``Tier0()`` default of ``tier1``), and on tier
    2 when ``storage`` is given, with its state; see :func:`classify` for the order."""
    observed = observe_tier1(tier1)
    root0 = tier0_root(tier1, tier0)
    if root0 is not None:
        observed += observe_tier0(root0)
    if storage is not None:
        observed += observe_tier2(storage)
    cat = Tier1Catalog(tier1)
    return classify(observed, upload=cat.uploads.upload_records(), pins=cat.pins(),
                    now=time.time() if now is None else now)


@dataclasses.dataclass(frozen=True)
class UploadCadence:
    """What the job's tier-2 policy copies next, from what it recorded on tier 1:
    ``upload_every`` (every Nth commit), ``counted`` commits since the last one marked,
    ``waiting`` steps marked or asked for and not yet on tier 2 (oldest first)."""

    upload_every: int
    counted: int
    waiting: tuple[int, ...]

    @property
    def commits_to_next(self) -> int:
        """Commits until the next one is marked for tier 2 (1: the next commit)."""
        return self.upload_every - self.counted

    def to_json(self) -> dict[str, Any]:
        return {"upload_every": self.upload_every, "counted": self.counted,
                "commits_to_next": self.commits_to_next, "waiting": list(self.waiting)}

    def describe(self) -> str:
        """One line for ``tierckpt ls``."""
        every = "every commit" if self.upload_every == 1 else \
            f"one commit in {self.upload_every} ({self.counted} counted since the last)"
        nxt = "the next commit" if self.commits_to_next == 1 else \
            f"the commit {self.commits_to_next} from now"
        wait = f"; waiting: {', '.join(map(str, self.waiting))}" if self.waiting else ""
        return f"tier 2 copies {every}, and the newest at a clean close; next: {nxt}{wait}"


def upload_cadence(tier1: Path) -> UploadCadence | None:
    """The job's upload cadence on ``tier1``, or None when no job with a tier 2 recorded
    one (no policy: the root has no uploader)."""
    cat = Tier1Catalog(tier1)
    try:
        recorded = cat.recorded_policy()
    except IntegrityError:
        return None
    if recorded is None:
        return None
    counted = cat.uploads.upload_cadence()
    done = cat.uploads.uploaded_steps()
    floor = max(done, default=-1)
    waiting = sorted(s for s in cat.uploads.split_pins()[1] if s > floor and s not in done)
    return UploadCadence(upload_every=recorded.policy.upload_every,
                         counted=0 if counted is None else counted[0], waiting=tuple(waiting))
