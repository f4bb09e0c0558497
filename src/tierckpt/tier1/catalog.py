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
named by a pin file; *uploaded* = its upload record is done
(:data:`tierckpt.tier1.uploads.UPLOAD_DONE`). Writing a new checkpoint is
:mod:`tierckpt.tier1.commit`; this module never creates one. The bounded reads live in
:mod:`tierckpt.tier1.manifests`, the pin files in :mod:`tierckpt.tier1.pins`, the upload
ledger (marks, requests, records) in :mod:`tierckpt.tier1.uploads` (:attr:`Tier1Catalog.uploads`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError, IntegrityError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.policy import retention
from tierckpt.tier1 import fs
from tierckpt.tier1 import pins as pin_files
from tierckpt.tier1.lock import FileLock

# Re-exported: the restore path (and its tests) read checkpoints through these names here.
from tierckpt.tier1.manifests import MANIFEST_LIMIT as MANIFEST_LIMIT
from tierckpt.tier1.manifests import read_committed as read_committed
from tierckpt.tier1.manifests import read_domain as read_domain
from tierckpt.tier1.manifests import read_part as read_part
from tierckpt.tier1.manifests import read_small as read_small
from tierckpt.tier1.uploads import UploadLedger

QUARANTINE_REASON = "QUARANTINE_REASON"
_REASON_SUFFIX = ".reason"


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
        self.uploads = UploadLedger(self.root)
        """The upload ledger of this root: marks, requests and the uploader's records."""

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
        return pin_files.read_pins(self.root)

    def pin(self, step: int, holder: str) -> None:
        """Pin ``step`` for ``holder`` (durably: retention sees it before this returns)."""
        pin_files.pin(self.root, step, holder)

    def unpin(self, step: int, holder: str) -> None:
        pin_files.unpin(self.root, step, holder)

    def request_upload(self, step: int) -> None:
        """Ask the uploader to copy ``step`` next, whatever its cadence
        (:meth:`UploadLedger.request_upload`; the manager's emergency save calls it here)."""
        self.uploads.request_upload(step)

    def unpin_all(self, holder: str) -> None:
        """Remove every pin of ``holder`` (e.g. left by a killed uploader)."""
        for step, holders in self.pins().items():
            if holder in holders:
                self.unpin(step, holder)

    # -- the job's records for its uploader and for gc ------------------------------------
    def tier2_probe(self) -> dict[str, Any] | None:
        """The tier-2 probe recorded by the job (``upload-state/tier2-probe.json``), or None
        when there is none or it cannot be read (the caller probes again)."""
        try:
            d = json.loads(read_small(self.uploads.upload_state_dir() / layout.TIER2_PROBE))
        except (OSError, ValueError, IntegrityError):
            return None
        return d if isinstance(d, dict) else None

    def write_tier2_probe(self, result: dict[str, Any], *,
                          dir_mode: int = fs.DEFAULT_DIR_MODE) -> None:
        """Record the tier-2 probe (:mod:`tierckpt.tier2.probe`) for this root's uploader."""
        path = self.uploads.upload_state_dir() / layout.TIER2_PROBE
        path.parent.mkdir(mode=dir_mode, exist_ok=True)
        fs.write_durably(path, json.dumps(result, sort_keys=True).encode() + b"\n")

    def policy_path(self) -> Path:
        return self.uploads.upload_state_dir() / layout.JOB_POLICY

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

    def retention_plan(self, policy: retention.RetentionPolicy, *,
                       uploader: bool) -> retention.Tier1Plan:
        """Tier-1 retention of this root as it is now
        (:func:`tierckpt.policy.retention.tier1_plan`): its complete steps, its pins and,
        when ``uploader`` (the root is served by a tier-2 uploader), what is not yet
        uploaded. A step marked or requested for tier 2 (:meth:`UploadLedger.count_commit`,
        :meth:`request_upload`) is held as a due step, not pinned: once a newer step is on
        tier 2 it is no longer held. Callers decide ``uploader``: a job from its own config
        (``tier2``), an offline tool from :meth:`UploadLedger.has_upload_records` or a
        tier 2 it was given."""
        pinned, asked = self.uploads.split_pins()
        return retention.tier1_plan(self.complete_steps(), policy=policy, pinned=pinned,
                                    uploaded=self.uploads.uploaded_steps() if uploader else None,
                                    marked=asked)

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
