"""The tier-1 catalogue: the only code that reads or changes the layout of a tier-1 root.

Everything the job, the uploader, resume, ``tierckpt ls/gc/verify/fetch`` and the drills
know about a root comes from a :class:`Tier1Catalog` (names from :mod:`tierckpt.format.layout`)::

    <root>/
      step-XXXXXXXX/        committed when it holds a COMPLETE that vouches for manifest.json
      step-XXXXXXXX.tmp-*/  a save or fetch in progress, or debris of a crashed one
      step-XXXXXXXX.del-*/  a checkpoint being deleted (unpublished first, reclaimed after)
      quarantine/           candidates moved aside, each with a QUARANTINE_REASON; never deleted
      pins/                 step-XXXXXXXX.<holder>: retention keeps a pinned step
      upload-state/         the uploader's per-step records, its lock and its log, and
                            policy.json: the job's retention, for ``tierckpt gc``
      events.jsonl          the event log (:mod:`tierckpt.runtime.events`)
      .lock                 held by the job writing this root

Meanings every caller shares: *complete* = a final-named directory with a ``COMPLETE`` file
(cheap, unverified: for retention, upload policy and listings); *committed* = one whose
marker and manifest verify (:meth:`Tier1Catalog.read_committed`, bounded reads); *pinned* =
named by a pin file; *uploaded* = its upload record is done (:data:`UPLOAD_DONE`). Writing a
new checkpoint is :mod:`tierckpt.tier1.commit`; this module never creates one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError, IntegrityError, SignatureError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.policy import retention
from tierckpt.tier1 import fs
from tierckpt.tier1.lock import FileLock

_log = logging.getLogger("tierckpt")

SMALL_FILE_LIMIT = 64 << 20
"""Largest marker or small record any reader accepts (bytes); larger is an IntegrityError."""
MANIFEST_LIMIT = 1 << 30
"""Largest ``manifest.json`` any reader accepts (bytes). It lists every rank's files with a
CRC32C per record, so it grows with ranks × tensors: ~94 KiB per rank for a Llama-70B
state, 386 MiB at 4,096 ranks — past the 64 MiB small-file bound near 540 ranks, where a
restore refused the checkpoint it had just written (``bench --scale``). 1 GiB holds that
state up to ~11,000 ranks; a hostile file still cannot exhaust memory unbounded."""
QUARANTINE_REASON = "QUARANTINE_REASON"
UPLOAD_HOLDER = "upload"
"""Pin holder name of the tier-2 uploader."""
UPLOAD_REQUEST = "upload-request"
"""Pin holder of a step the job asked to have uploaded whatever ``upload_every`` says (an
emergency save); the uploader removes the pin once the step is verified on tier 2."""
UPLOAD_DUE = "upload-due"
"""Pin holder of a step the job marked as its every-``upload_every``-th commit on tier 1:
held for the uploader like any due step (within ``Tier2.backlog``), not a hard pin; the
uploader removes the mark once the step is verified on tier 2."""
_UPLOAD_COUNT = ".upload-count.json"
"""In ``pins/``: commits counted since the last mark, and the last step counted."""
UPLOAD_DONE = frozenset({"verified", "files_verified", "conflict"})
"""Upload statuses after which tier-1 retention need not keep a step for the uploader."""
UPLOAD_LOG = "uploader.log"
_UPLOAD_LOCK = ".lock"
_REASON_SUFFIX = ".reason"


def read_small(path: str | os.PathLike[str], limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The whole of a small file (a marker or manifest), refusing one over ``limit`` bytes
    with :class:`IntegrityError`: a damaged or hostile file must not exhaust memory."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise IntegrityError(f"{Path(path).name} is larger than {limit} bytes")
    return data


def _read_marker(ckpt_dir: Path) -> bytes:
    try:
        return read_small(ckpt_dir / layout.COMPLETE)
    except FileNotFoundError:
        raise IntegrityError("no COMPLETE marker (the save never committed)") from None


def read_committed(ckpt_dir: Path, *, step: int | None, rebuild: bool = True
                   ) -> mf.Committed:
    """The verified manifest of the checkpoint directory ``ckpt_dir``: marker and
    manifest read with :data:`SMALL_FILE_LIMIT` and :data:`MANIFEST_LIMIT`, the marker
    checked against the manifest (and its signature when a key is set) and, unless
    ``step`` is None, the manifest's step against the directory's. A ``manifest.json``
    that is missing or fails its marker is rebuilt from the manifest parts when they hold
    it exactly (:func:`rebuild_manifest`; logged): the same bytes the marker vouches for
    (``rebuild=False``: not, for a check that reports the damaged file). Raises
    :class:`IntegrityError` (no marker, no manifest, any mismatch) or ``OSError``. Nothing
    of the checkpoint may be opened before this returns."""
    marker = _read_marker(ckpt_dir)
    try:
        try:
            mbytes = read_small(ckpt_dir / layout.MANIFEST, MANIFEST_LIMIT)
        except FileNotFoundError:
            raise IntegrityError("COMPLETE present but manifest.json missing") from None
        return mf.verify_committed(marker, mbytes, step=step, name="directory")
    except SignatureError:
        raise
    except IntegrityError as e:
        rebuilt = rebuild_manifest(ckpt_dir, marker, step=step) if rebuild else None
        if rebuilt is None:
            raise
        _log.warning("%s: %s; rebuilt from its manifest parts, which its COMPLETE marker "
                     "vouches for", ckpt_dir, e)
        return rebuilt


def rebuild_manifest(ckpt_dir: Path, marker: bytes, *, step: int | None
                     ) -> mf.Committed | None:
    """The manifest of ``ckpt_dir`` assembled from its parts (:func:`~tierckpt.format.
    manifest.assemble`) and verified against ``marker`` like ``manifest.json`` itself, or
    None when the parts cannot rebuild it (none, missing, damaged, or from before they
    carried the header). Reads every part: for the rare damaged manifest only."""
    names = mf.marker_parts(marker)
    if not names:
        return None
    try:
        parts = {n: read_small(ckpt_dir / n, MANIFEST_LIMIT) for n in names}
        return mf.verify_committed(marker, mf.assemble(parts), step=step, name="directory")
    except SignatureError:
        raise
    except (IntegrityError, OSError):
        return None


def read_domain(ckpt_dir: Path, *, step: int | None, domain: tuple[int, ...],
                world_size: int) -> mf.Manifest | None:
    """What a domain restoring ``ckpt_dir`` on its saved layout needs of the manifest,
    from the parts alone: a manifest with the header (step, world size, domains, versions)
    that lists **only** the files of ``domain``'s ranks and the shared ones (the parts
    among them: only this domain's are read and checked). O(``domain``) reads, none of
    them O(W), each part verified against the marker (its digest, signed with a key).

    None when the marker vouches for no parts, the first part carries no header, or the
    job's layout is not the saved one (the caller reads the whole manifest). Raises
    :class:`IntegrityError` for a missing or damaged part (the caller may read the whole
    manifest instead), :class:`~tierckpt.errors.SignatureError` as :func:`read_committed`
    does, ``OSError``."""
    marker = _read_marker(ckpt_dir)
    names = mf.marker_parts(marker)
    if not names:
        return None
    key = mf.signing_key()

    read: dict[str, bytes] = {}

    def part(name: str) -> mf.Manifest:
        try:
            read[name] = read_small(ckpt_dir / name, MANIFEST_LIMIT)
        except FileNotFoundError:
            raise IntegrityError(f"COMPLETE names {name} but it is missing") from None
        return mf.verify_part(marker, name, read[name], key)

    head = part(names[0])
    if not mf.has_header(head) or head.world_size != world_size \
            or tuple(domain) not in head.domains:
        return None
    if step is not None and head.step != step:
        raise IntegrityError(f"directory is named for step {step} but its manifest is step "
                             f"{head.step} (renamed by hand?)")
    wanted, mine = set(domain), sorted({layout.part_filename(r) for r in domain})
    files: dict[str, mf.FileEntry] = {}
    for name in mine:
        for f in (head if name == names[0] else part(name)).files:
            if f.rank is None or f.rank in wanted:
                files[f.name] = f
    # this domain's parts, as the whole manifest lists them (from the bytes just verified)
    files.update((f.name, f) for f in mf.part_entries({n: read[n] for n in mine}))
    return dataclasses.replace(head, files=tuple(files.values()))


def read_part(ckpt_dir: Path, rank: int) -> mf.Manifest | None:
    """``rank``'s manifest part of the checkpoint directory ``ckpt_dir``, verified against
    its marker (:func:`tierckpt.format.manifest.verify_part`: it lists only that rank's
    group's files and the shared ones), or None when the marker vouches for no parts (a
    checkpoint from before them). Raises :class:`IntegrityError` (no marker, a missing or
    damaged part: the caller reads the whole manifest instead) or ``OSError``."""
    marker = _read_marker(ckpt_dir)
    if not mf.marker_parts(marker):
        return None
    name = layout.part_filename(rank)
    try:
        data = read_small(ckpt_dir / name, MANIFEST_LIMIT)
    except FileNotFoundError:
        raise IntegrityError(f"COMPLETE names {name} but it is missing") from None
    return mf.verify_part(marker, name, data, mf.signing_key(), rank=rank)


@dataclasses.dataclass(frozen=True)
class RecordedPolicy:
    """The retention a job with a tier 2 recorded for its root when it started
    (``upload-state/policy.json``, :meth:`Tier1Catalog.write_policy`): what ``tierckpt gc``
    applies unless told otherwise."""

    tier2: str
    policy: retention.RetentionPolicy
    path: Path


@dataclasses.dataclass(frozen=True)
class Quarantined:
    """One entry of ``quarantine/``: its directory and the recorded reason (None if none)."""

    path: Path
    reason: str | None


class Tier1Catalog:
    """What is on one tier-1 root, and the few changes to its layout that are not a commit.

    Cheap to construct (no I/O); every method reads the root afresh, so two catalogues of
    the same root (the job's and its uploader's) always agree.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def step_dir(self, step: int) -> Path:
        return self.root / layout.step_dirname(step)

    # -- checkpoints ----------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Steps of final-named directories that hold a COMPLETE file, newest first; []
        when the root does not exist. Unverified (see the module docstring)."""
        if not self.root.is_dir():
            return []
        out = []
        for e in os.scandir(self.root):
            step = layout.parse_step_dirname(e.name)
            if step is not None and e.is_dir(follow_symlinks=False) and \
                    os.path.exists(os.path.join(e.path, layout.COMPLETE)):
                out.append(step)
        return sorted(out, reverse=True)

    def has_marker(self, step: int) -> bool:
        """Whether ``step``'s entry holds a COMPLETE file (unverified; a dangling link
        counts, so ``ls`` can show it as invalid rather than hide it)."""
        return os.path.lexists(self.step_dir(step) / layout.COMPLETE)

    def candidate_steps(self) -> list[int]:
        """Every final-named entry (complete or not, directory or not), newest first."""
        steps = [layout.parse_step_dirname(n) for n in os.listdir(self.root)]
        return sorted((s for s in steps if s is not None), reverse=True)

    def in_progress(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every tmp directory: saves or fetches running or crashed."""
        out = []
        for e in os.scandir(self.root):
            tmp = layout.parse_tmp_dirname(e.name)
            if tmp is not None and e.is_dir(follow_symlinks=False):
                out.append((tmp[0], Path(e.path)))
        return out

    def read_committed(self, step: int) -> mf.Committed:
        """The verified manifest of ``step``'s checkpoint (see :func:`read_committed`)."""
        return read_committed(self.step_dir(step), step=step)

    # -- pins -----------------------------------------------------------------------------
    def pins(self) -> dict[int, list[str]]:
        """Pin holders by step, from ``pins/step-XXXXXXXX.<holder>`` files."""
        out: dict[int, list[str]] = {}
        d = self.root / layout.PINS
        if d.is_dir():
            for name in sorted(os.listdir(d)):
                step = layout.parse_pin_filename(name)
                if step is not None and "." in name:
                    out.setdefault(step, []).append(name.split(".", 1)[1])
        return out

    def pin(self, step: int, holder: str) -> None:
        """Pin ``step`` for ``holder`` (durably: retention sees it before this returns)."""
        path = self.root / layout.PINS / layout.pin_filename(step, holder)
        path.parent.mkdir(mode=fs.DEFAULT_DIR_MODE, exist_ok=True)
        fs.write_durably(path, b"")

    def unpin(self, step: int, holder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / layout.PINS / layout.pin_filename(step, holder))

    def request_upload(self, step: int) -> None:
        """Ask the uploader to copy ``step`` next, whatever its cadence (pins it)."""
        self.pin(step, UPLOAD_REQUEST)

    def upload_requests(self) -> set[int]:
        """Steps asked for by :meth:`request_upload` and not yet verified on tier 2."""
        return {s for s, holders in self.pins().items() if UPLOAD_REQUEST in holders}

    def upload_marks(self) -> set[int]:
        """Steps the job marked due for tier 2 (:meth:`count_commit`), not yet uploaded."""
        return {s for s, holders in self.pins().items() if UPLOAD_DUE in holders}

    def count_commit(self, step: int, *, upload_every: int) -> bool:
        """Count ``step``, just committed here, for the upload cadence
        (:func:`tierckpt.policy.retention.count_commit`) and mark it due when it is the
        ``upload_every``-th since the last mark; returns whether it was marked. The count
        survives restarts (a durable file beside the pins); counting one step twice (a
        flush of a step already counted) changes nothing. Domain owners only."""
        path = self.root / layout.PINS / _UPLOAD_COUNT
        try:
            d = json.loads(read_small(path))
            count, last = int(d["count"]), int(d["step"])
        except (OSError, ValueError, KeyError, TypeError, IntegrityError):
            count, last = 0, -1
        if step <= last:
            return step in self.upload_marks()
        count, due = retention.count_commit(count, upload_every=upload_every)
        if due:
            self.pin(step, UPLOAD_DUE)
        path.parent.mkdir(mode=fs.DEFAULT_DIR_MODE, exist_ok=True)
        fs.write_durably(path, json.dumps({"count": count, "step": step}).encode())
        return due

    def upload_cadence(self) -> tuple[int, int] | None:
        """``(counted, last step counted)`` of the upload cadence, or None before the
        first commit was counted."""
        try:
            d = json.loads(read_small(self.root / layout.PINS / _UPLOAD_COUNT))
            return int(d["count"]), int(d["step"])
        except (OSError, ValueError, KeyError, TypeError, IntegrityError):
            return None

    def unpin_all(self, holder: str) -> None:
        """Remove every pin of ``holder`` (e.g. left by a killed uploader)."""
        for step, holders in self.pins().items():
            if holder in holders:
                self.unpin(step, holder)

    # -- upload records -------------------------------------------------------------------
    def upload_state_dir(self) -> Path:
        return self.root / layout.UPLOAD_STATE

    def has_upload_records(self) -> bool:
        """Whether an uploader has ever served this root (its ``upload-state/`` exists)."""
        return self.upload_state_dir().is_dir()

    def _record_path(self, step: int) -> Path:
        return self.upload_state_dir() / f"{layout.step_dirname(step)}.json"

    def upload_record(self, step: int) -> dict[str, Any] | None:
        """The recorded upload state of ``step``, or None (missing or unreadable)."""
        try:
            d = json.loads(read_small(self._record_path(step)))
        except (OSError, ValueError, IntegrityError):
            return None
        return d if isinstance(d, dict) else None

    def write_upload_record(self, step: int, **fields: Any) -> None:
        """Record ``step``'s upload state durably (the fields of the uploader's schema)."""
        path = self._record_path(step)
        path.parent.mkdir(mode=fs.DEFAULT_DIR_MODE, exist_ok=True)
        body = {"step": step, "updated_unix": time.time(), **fields}
        fs.write_durably(path, json.dumps(body, sort_keys=True).encode() + b"\n")

    def upload_records(self) -> dict[int, dict[str, Any]]:
        """Every readable upload record, by step."""
        out: dict[int, dict[str, Any]] = {}
        d = self.upload_state_dir()
        if not d.is_dir():
            return out
        for name in os.listdir(d):
            step = layout.parse_step_dirname(name.removesuffix(".json"))
            if step is not None and name.endswith(".json"):
                rec = self.upload_record(step)
                if rec is not None:
                    out[step] = rec
        return out

    def tier2_probe(self) -> dict[str, Any] | None:
        """The tier-2 probe recorded by the job (``upload-state/tier2-probe.json``), or None
        when there is none or it cannot be read (the caller probes again)."""
        try:
            d = json.loads(read_small(self.upload_state_dir() / layout.TIER2_PROBE))
        except (OSError, ValueError, IntegrityError):
            return None
        return d if isinstance(d, dict) else None

    def write_tier2_probe(self, result: dict[str, Any], *,
                          dir_mode: int = fs.DEFAULT_DIR_MODE) -> None:
        """Record the tier-2 probe (:mod:`tierckpt.tier2.probe`) for this root's uploader."""
        path = self.upload_state_dir() / layout.TIER2_PROBE
        path.parent.mkdir(mode=dir_mode, exist_ok=True)
        fs.write_durably(path, json.dumps(result, sort_keys=True).encode() + b"\n")

    def policy_path(self) -> Path:
        return self.upload_state_dir() / layout.JOB_POLICY

    def write_policy(self, *, tier2: str, policy: retention.RetentionPolicy,
                     file_mode: int = fs.DEFAULT_FILE_MODE,
                     dir_mode: int = fs.DEFAULT_DIR_MODE) -> Path:
        """Record, durably, the retention of the job writing this root with tier 2
        ``tier2`` (replacing an earlier record: the newest job's policy is the one that
        applies). Returns the file's path."""
        path = self.policy_path()
        path.parent.mkdir(mode=dir_mode, exist_ok=True)
        body = {"tier2": tier2, "keep_last": policy.keep_last,
                "upload_every": policy.upload_every, "tier2_keep_last": policy.tier2_keep_last,
                "tier2_keep_every": policy.tier2_keep_every, "updated_unix": time.time()}
        fs.write_durably(path, json.dumps(body, sort_keys=True).encode() + b"\n", mode=file_mode)
        return path

    def recorded_policy(self) -> RecordedPolicy | None:
        """The policy :meth:`write_policy` recorded, or None when none was (no job with a
        tier 2 has started on this root). A record that cannot be read or does not hold a
        valid policy raises :class:`IntegrityError` naming the file: gc must not fall back
        to defaults that may delete what the job keeps."""
        path = self.policy_path()
        try:
            d = json.loads(read_small(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise IntegrityError(f"{path} is unreadable ({e}); delete it, or give every "
                                 "retention knob explicitly") from None
        try:
            if not isinstance(d, dict) or not isinstance(d.get("tier2"), str):
                raise ValueError("not an object with a tier2 URL")
            knobs = {k: d[k] for k in ("keep_last", "upload_every", "tier2_keep_last",
                                       "tier2_keep_every")}
            return RecordedPolicy(tier2=d["tier2"], policy=retention.RetentionPolicy(**knobs),
                                  path=path)
        except (KeyError, ValueError) as e:  # ConfigError is a ValueError
            raise IntegrityError(f"{path} does not hold a valid policy ({e}); delete it, or "
                                 "give every retention knob explicitly") from None

    def uploaded_steps(self) -> set[int]:
        """Steps whose upload is done (:data:`UPLOAD_DONE`): as far as the uploader is
        concerned, tier-1 retention may delete them."""
        return {s for s, r in self.upload_records().items() if r.get("status") in UPLOAD_DONE}

    def retention_plan(self, policy: retention.RetentionPolicy, *,
                       uploader: bool) -> retention.Tier1Plan:
        """Tier-1 retention of this root as it is now
        (:func:`tierckpt.policy.retention.tier1_plan`): its complete steps, its pins and,
        when ``uploader`` (the root is served by a tier-2 uploader), what is not yet
        uploaded. A step marked or requested for tier 2 (:meth:`count_commit`,
        :meth:`request_upload`) is held as a due step, not pinned: once a newer step is on
        tier 2 it is no longer held. Callers decide ``uploader``: a job from its own config
        (``tier2``), an offline tool from :meth:`has_upload_records` or a tier 2 it was given."""
        pinned, asked = self.split_pins()
        return retention.tier1_plan(self.complete_steps(), policy=policy, pinned=pinned,
                                    uploaded=self.uploaded_steps() if uploader else None,
                                    marked=asked)

    def split_pins(self) -> tuple[set[int], set[int]]:
        """``(pinned, asked)``: steps retention must keep whatever happens (a pin held by
        anything but the job's asks of tier 2), and steps marked or requested for tier 2
        (:meth:`count_commit`, :meth:`request_upload`), which it holds only while they are
        still due (see :meth:`retention_plan`)."""
        asks = {UPLOAD_DUE, UPLOAD_REQUEST}
        pins = self.pins()
        return ({s for s, h in pins.items() if not set(h) <= asks},
                {s for s, h in pins.items() if asks & set(h)})

    # -- quarantine -----------------------------------------------------------------------
    def quarantine(self, step: int, reason: str, *, suffix: str = "") -> Path:
        """Move ``step``'s entry into ``quarantine/`` (renamed, fsync'd, never deleted) with
        ``reason`` in its ``QUARANTINE_REASON`` file — or, for an entry that is not a real
        directory (a symlink is never followed), in ``<entry>.reason`` beside it. Returns
        where the entry went."""
        src = self.step_dir(step)
        moved = fs.move_aside(src, self.root / layout.QUARANTINE, src.name + suffix)
        fs.write_durably(self._reason_path(moved), f"{reason}\n".encode())
        return moved

    @staticmethod
    def _reason_path(entry: Path) -> Path:
        if entry.is_dir() and not entry.is_symlink():
            return entry / QUARANTINE_REASON
        return entry.with_name(entry.name + _REASON_SUFFIX)

    def quarantined(self) -> list[Quarantined]:
        """Everything in ``quarantine/``, by name."""
        d = self.root / layout.QUARANTINE
        if not d.is_dir():
            return []
        out = []
        for name in sorted(os.listdir(d)):
            if name.endswith(_REASON_SUFFIX):
                continue
            try:
                reason: str | None = self._reason_path(d / name).read_text().strip()
            except OSError:
                reason = None
            out.append(Quarantined(d / name, reason))
        return out

    # -- locks, debris and deletion -------------------------------------------------------
    def prepare(self, *, dir_mode: int, file_mode: int) -> None:
        """Create the root if needed and prove it writable (a durable empty probe file);
        ConfigError naming the root otherwise."""
        try:
            self.root.mkdir(mode=dir_mode, parents=True, exist_ok=True)
            probe = self.root / f".writable-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            fs.write_durably(probe, b"", mode=file_mode)
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"tier1={self.root} is not a writable directory ({e}); point "
                              "tier1 at a local directory this user can write") from e

    def lock(self, file_mode: int = fs.DEFAULT_FILE_MODE) -> FileLock:
        """The job lock (``<root>/.lock``), held by a job — or ``tierckpt gc``/``fetch`` —
        for as long as it changes this root. Raises LockError when another holds it."""
        return FileLock(self.root / layout.LOCK, file_mode=file_mode, root=self.root, busy=(
            f"another job is writing checkpoints to {self.root} ({{holder}}); give each job its "
            "own tier1 directory, or stop the other job first"))

    def uploader_lock(self) -> FileLock:
        """The uploader lock (``upload-state/.lock``): one uploader per root."""
        self.upload_state_dir().mkdir(mode=fs.DEFAULT_DIR_MODE, parents=True, exist_ok=True)
        return FileLock(self.upload_state_dir() / _UPLOAD_LOCK, root=self.root,
                        busy=f"another uploader is running for {self.root} ({{holder}})")

    def stale_entries(self) -> list[Path]:
        """Tmp and half-deleted directories (crashed saves, fetches and deletions)."""
        return sorted(Path(e.path) for e in os.scandir(self.root)
                      if e.is_dir(follow_symlinks=False) and (
                          layout.parse_tmp_dirname(e.name) or layout.is_deleting_dirname(e.name)))

    def clean_stale(self) -> list[Path]:
        """Remove :meth:`stale_entries`. Complete checkpoints are never touched. Call only
        while holding :meth:`lock`, so no live save is affected. Returns what was removed."""
        removed = self.stale_entries()
        for path in removed:
            fs.remove_tree(path)
        if removed:
            fs.fsync_dir(self.root)
        return removed

    def unpublish(self, step: int) -> Path:
        """First half of a deletion: rename the checkpoint out of its final name (atomic,
        fsync'd), so it no longer exists for resume. Returns the path to reclaim with
        :func:`tierckpt.tier1.fs.remove_tree` (start-up cleanup reclaims it after a crash)."""
        src = self.step_dir(step)
        dst = self.root / layout.deleting_dirname(step, uuid.uuid4().hex[:8])
        os.rename(src, dst)
        fs.fsync_dir(self.root)
        return dst

    def delete(self, step: int) -> None:
        """Delete a committed checkpoint: unpublish first, so a crash mid-delete never leaves
        a half-deleted directory that looks committed."""
        fs.remove_tree(self.unpublish(step))
