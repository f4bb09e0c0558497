"""What an uploader does (:class:`UploaderConfig`) and what one upload came to
(:class:`UploadResult`), with the statuses both share.

Upload records, per step, in ``<tier1>/upload-state/step-XXXXXXXX.json`` (written durably
through :meth:`tierckpt.tier1.catalog.Tier1Catalog.write_upload_record`)::

    {"step": int, "save_id": str, "tier2": url, "status": STATUS, "bytes": int,
     "seconds": float, "updated_unix": float, "error": str (failed/conflict only)}

``STATUS`` is ``uploading``, ``files_verified`` (this root's files are on tier 2, the
marker waits for other nodes), ``verified`` (marker written and checked), ``failed`` (will
be retried) or ``conflict`` (tier 2 holds a different checkpoint for the step; never
retried). A result (never recorded) may also be ``gone`` (deleted from tier 1 before it
could be pinned: not an error) or ``stopped`` (asked to stop between files).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.tier1.uploads import UPLOAD_DONE

DONE = UPLOAD_DONE
"""Statuses after which a step is not uploaded again."""
OK = DONE | {"gone"}
"""Results after which the loop goes on to the next step (not a failure)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class UploaderConfig:
    """What to upload, where, and tier-2 retention (validated as the job's config is)."""

    tier1: Path
    """The tier-1 root this uploader serves (one uploader per root)."""
    tier2: str
    """The tier-2 URL, one of :data:`tierckpt.tier2.storage.url.FORMS` (see
    :func:`tierckpt.tier2.storage.open_storage`)."""
    upload_every: int = 1
    """Upload every Nth checkpoint committed on tier 1 (those marked by the job, or by
    this uploader with ``count_commits``); 1 uploads every one."""
    count_commits: bool = False
    """Count the commits no job counted (a root written without tier 2) for
    ``upload_every`` before each look at tier 1, oldest first, as a job counts its own:
    what ``tierckpt upload --every N`` does. A job's uploader leaves it off: the job counts
    as it commits."""
    keep_last: int = 3
    """Tier-2 retention: newest complete checkpoints kept."""
    keep_every: int = 0
    """Tier-2 retention: steps that are multiples of this are kept forever (0: none)."""
    poll_s: float = 2.0
    """Seconds between looks at tier 1 when idle."""
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Options of the object store :attr:`tier2` names, the fields of its config
    (``S3Config``, ``GCSConfig``, ``AzureConfig``: :func:`tierckpt.tier2.storage.
    open_storage`); none for ``file://``. Without ``integrity`` among them the uploader adds
    the modes the job's probe chose (:meth:`tierckpt.tier2.probe.ProbeResult.
    store_options`)."""
    s3_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False,
                                                              compare=False)
    """Deprecated keyword: the old name of :attr:`storage_options`, from when only S3 took
    options. Given, it becomes :attr:`storage_options` (a DeprecationWarning; a ConfigError
    if both are given) and reads back as None afterwards: read :attr:`storage_options`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier1", Path(self.tier1))
        if self.s3_options is not None:
            if self.storage_options:
                raise ConfigError("give storage_options only (s3_options is its old name)")
            warnings.warn("UploaderConfig(s3_options=...) is deprecated: the options apply "
                          "to every object store; write storage_options=...",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "storage_options", self.s3_options)
            object.__setattr__(self, "s3_options", None)
        _ = self.retention  # a RetentionPolicy: validates the counts, naming a bad one
        if not isinstance(self.poll_s, int | float) or not self.poll_s > 0:
            raise ConfigError(f"poll_s must be > 0 seconds, got {self.poll_s}")

    @property
    def retention(self) -> RetentionPolicy:
        """The tier-2 side of the job's retention (tier-1 knobs at their defaults)."""
        return RetentionPolicy(upload_every=self.upload_every, tier2_keep_last=self.keep_last,
                               tier2_keep_every=self.keep_every)


@dataclasses.dataclass(frozen=True)
class UploadResult:
    """Outcome of one upload attempt of ``step``. ``bytes`` were sent this time."""

    step: int
    status: str
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
