"""Names on disk and in the bucket, and their parsing. Pure: no I/O.

A tier-1 root looks like this::

    <root>/
      step-00000100/            a committed checkpoint (valid only with a matching COMPLETE)
        .metadata               DCP metadata (a pickle: never opened before verification)
        __0_0.distcp ...        DCP shard files, one or more per rank
        __0.metadata ...        each rank's own DCP metadata (its items only: what a restore
                                on the saved layout reads instead of .metadata)
        __0.records ...         each rank's per-record CRC32Cs of its shard files
        manifest.00000.json ... the manifest's entries of ranks 0-7, 8-15, ... (and the
                                shared files'): what one rank reads on the saved layout
        manifest.json           sizes and CRC32C of every file above
        COMPLETE                written last; holds the manifest digest
      step-00000200.tmp-<id>/   a save in progress (or a crashed one: removed at start-up)
      step-00000050.del-<id>/   a checkpoint being deleted (removed at start-up)
      quarantine/               candidates that failed verification, moved aside, never deleted
      pins/                     step-00000100.<holder> files: pinned checkpoints are kept
      events.jsonl              the append-only event log
      .lock                     held (flock) by the job that writes this root

In object storage a checkpoint is the same names under ``<prefix>/step-XXXXXXXX/``.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from tierckpt.errors import IntegrityError

METADATA = ".metadata"
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
EVENTS = "events.jsonl"
QUARANTINE = "quarantine"
PINS = "pins"
LOCK = ".lock"
UPLOAD_STATE = "upload-state"
JOB_POLICY = "policy.json"
TIER2_PROBE = "tier2-probe.json"
"""In ``upload-state/``: the retention of the job that writes the root with a tier 2 (its
``tier2`` URL, ``keep_last``, ``upload_every``, ``tier2_keep_last``, ``tier2_keep_every``),
recorded when it starts, so ``tierckpt gc`` applies the job's policy by default."""

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_TMP_RE = re.compile(r"^step-(\d{8,})\.tmp-([0-9a-zA-Z_-]+)$")
_DEL_RE = re.compile(r"^step-(\d{8,})\.del-([0-9a-zA-Z_-]+)$")
_SHARD_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")
_PART_RE = re.compile(r"^manifest\.(\d{5,})\.json$")


def step_dirname(step: int) -> str:
    """Final directory (or key prefix) name of the checkpoint of ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a final checkpoint name, or None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def tmp_dirname(step: int, save_id: str) -> str:
    """Directory a save of ``step`` writes into before it is committed."""
    return f"{step_dirname(step)}.tmp-{save_id}"


def parse_tmp_dirname(name: str) -> tuple[int, str] | None:
    """``(step, save_id)`` of a tmp directory name, or None."""
    m = _TMP_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def deleting_dirname(step: int, token: str) -> str:
    """A checkpoint is renamed to this before it is removed, so a crash mid-delete never
    leaves a half-deleted directory under a final name."""
    return f"{step_dirname(step)}.del-{token}"


def is_deleting_dirname(name: str) -> bool:
    return _DEL_RE.match(name) is not None


def shard_filename(rank: int, index: int) -> str:
    """DCP's shard file name for ``rank``'s ``index``-th file."""
    return f"__{rank}_{index}.distcp"


def shard_rank(name: str) -> int | None:
    """The rank that wrote a DCP shard file, or None when ``name`` is not a shard."""
    m = _SHARD_RE.match(name)
    return int(m.group(1)) if m else None


def rank_metadata_filename(rank: int) -> str:
    """The file with ``rank``'s own DCP metadata (DCP's own name for rank-local metadata,
    which ``FileSystemReader.read_metadata(rank=...)`` opens)."""
    return f"__{rank}{METADATA}"


def rank_records_filename(rank: int) -> str:
    """The file with the per-record CRC32Cs of ``rank``'s shard files
    (:mod:`tierckpt.format.records`)."""
    return f"__{rank}.records"


PART_RANKS = 8
"""Ranks per manifest part (:func:`part_filename`)."""


def part_filename(rank: int) -> str:
    """The manifest part that lists ``rank``'s files (ranks ``PART_RANKS`` × k to
    ``PART_RANKS`` × k + ``PART_RANKS`` − 1 share part k)."""
    return f"manifest.{rank // PART_RANKS:05d}.json"


def is_part(name: str) -> bool:
    """Whether ``name`` is a manifest part (:func:`part_filename`)."""
    return _PART_RE.match(name) is not None


def part_number(name: str) -> int | None:
    """k of part ``manifest.<k>.json`` (its ranks are ``PART_RANKS`` × k onwards), or None
    when ``name`` is not a part."""
    m = _PART_RE.match(name)
    return int(m.group(1)) if m else None


def rank_metadata_rank(name: str) -> int | None:
    """The rank of a rank-metadata file, or None when ``name`` is not one."""
    m = _RANK_METADATA_RE.match(name)
    return int(m.group(1)) if m else None


def pin_filename(step: int, holder: str) -> str:
    """Name of a pin file under ``pins/``: ``holder`` is who keeps ``step`` alive."""
    if not re.fullmatch(r"[0-9a-zA-Z_.-]+", holder):
        raise ValueError(f"pin holder must be [0-9a-zA-Z_.-]+, got {holder!r}")
    return f"{step_dirname(step)}.{holder}"


def parse_pin_filename(name: str) -> int | None:
    head = name.split(".", 1)[0]
    return parse_step_dirname(head)


def safe_member_name(name: str) -> str:
    """Validate a file name read from a manifest or a bucket listing.

    Checkpoint members are flat: a single path component, no ``..``, no separators, not
    absolute, no NUL. Anything else could escape the checkpoint root and is refused with
    :class:`IntegrityError` (it can only come from a corrupt or hostile manifest/listing).
    """
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or PurePosixPath(name).is_absolute()
    ):
        raise IntegrityError(f"refusing unsafe checkpoint member name {name!r}")
    return name


def object_key(prefix: str, step: int, member: str) -> str:
    """Object-store key of ``member`` of the checkpoint of ``step`` under ``prefix``."""
    safe_member_name(member)
    base = step_dirname(step)
    prefix = prefix.strip("/")
    return f"{prefix}/{base}/{member}" if prefix else f"{base}/{member}"
