"""The upload ledger of a tier-1 root: what the job asks of the tier-2 uploader, and what
the uploader has done, as files on the root itself.

- ``pins/step-XXXXXXXX.upload-due``: the job's every-``upload_every``-th commit
  (:meth:`UploadLedger.count_commit`), counted in ``pins/.upload-count.json`` so the
  cadence survives restarts;
- ``pins/step-XXXXXXXX.upload-request``: a step the job wants copied whatever the cadence
  (:meth:`UploadLedger.request_upload`, an emergency save);
- ``upload-state/step-XXXXXXXX.json``: the uploader's record of each step, written durably;
  a step whose status is in :data:`UPLOAD_DONE` is one tier-1 retention need not keep;
- ``upload-state/.lock``: one uploader per root.

Cheap to construct (no I/O); every method reads the root afresh, so the job's ledger and its
uploader's agree. :class:`tierckpt.tier1.catalog.Tier1Catalog` holds one as ``uploads``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tierckpt.errors import IntegrityError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.policy import retention
from tierckpt.tier1 import fs, pins
from tierckpt.tier1.lock import FileLock
from tierckpt.tier1.manifests import read_small

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


class UploadLedger:
    """The job's asks of tier 2 and the uploader's records, on one tier-1 root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # -- the job's asks -------------------------------------------------------------------
    def request_upload(self, step: int) -> None:
        """Ask the uploader to copy ``step`` next, whatever its cadence (pins it)."""
        pins.pin(self.root, step, UPLOAD_REQUEST)

    def upload_requests(self) -> set[int]:
        """Steps asked for by :meth:`request_upload` and not yet verified on tier 2."""
        return {s for s, holders in pins.read_pins(self.root).items()
                if UPLOAD_REQUEST in holders}

    def upload_marks(self) -> set[int]:
        """Steps the job marked due for tier 2 (:meth:`count_commit`), not yet uploaded."""
        return {s for s, holders in pins.read_pins(self.root).items()
                if UPLOAD_DUE in holders}

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
            pins.pin(self.root, step, UPLOAD_DUE)
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

    def split_pins(self) -> tuple[set[int], set[int]]:
        """``(pinned, asked)``: steps retention must keep whatever happens (a pin held by
        anything but the job's asks of tier 2), and steps marked or requested for tier 2
        (:meth:`count_commit`, :meth:`request_upload`), which it holds only while they are
        still due (see :meth:`tierckpt.tier1.catalog.Tier1Catalog.retention_plan`)."""
        asks = {UPLOAD_DUE, UPLOAD_REQUEST}
        held = pins.read_pins(self.root)
        return ({s for s, h in held.items() if not set(h) <= asks},
                {s for s, h in held.items() if asks & set(h)})

    # -- the uploader's records -----------------------------------------------------------
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

    def uploaded_steps(self) -> set[int]:
        """Steps whose upload is done (:data:`UPLOAD_DONE`) for the checkpoint now under the
        step: as far as the uploader is concerned, tier-1 retention may delete them. A record
        of an earlier save of the step (rolled back by a heal or a restart, then saved again)
        names another save id than the step's marker, and does not count: the new save is
        not on tier 2 yet."""
        return {s for s, r in self.upload_records().items()
                if r.get("status") in UPLOAD_DONE and self._same_save(s, r)}

    def _same_save(self, step: int, record: dict[str, Any]) -> bool:
        """Whether ``record`` is of the checkpoint now under ``step`` (one small read: the
        marker names the save). Without a save id on either side, or without a readable
        marker (the checkpoint's own state decides), the record stands."""
        if record.get("save_id") is None:
            return True
        try:
            now = mf.marker_body(read_small(self.root / layout.step_dirname(step) /
                                            layout.COMPLETE)).get("save_id")
        except (IntegrityError, OSError):
            return True
        return now in (None, record["save_id"])

    def uploader_lock(self) -> FileLock:
        """The uploader lock (``upload-state/.lock``): one uploader per root."""
        self.upload_state_dir().mkdir(mode=fs.DEFAULT_DIR_MODE, parents=True, exist_ok=True)
        return FileLock(self.upload_state_dir() / _UPLOAD_LOCK, root=self.root,
                        busy=f"another uploader is running for {self.root} ({{holder}})")
