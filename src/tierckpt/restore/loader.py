"""Load a verified tier-1 checkpoint into a :class:`~tierckpt.state.TrainState` with DCP,
resharding when the world size changed, and what a restore reports (:class:`RestoreInfo`)."""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from tierckpt._torch.dcp import create_chunk_list, flatten_state_dict, set_element
from tierckpt.errors import (
    CheckpointError,
    CorruptDataError,
    IntegrityError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from tierckpt.format import layout
from tierckpt.format.manifest import FileEntry, Manifest
from tierckpt.restore.reader import (
    RAM_PIECE,
    RAM_STREAMS,
    READ_STREAMS,
    DirectReader,
    directory_chunks,
)
from tierckpt.runtime.topology import Comm
from tierckpt.state import RANK_STATE, TrainState
from tierckpt.tier1.catalog import read_committed, read_part


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """What ``restore()`` loaded: the step, where from, how long, how many bytes."""

    step: int
    source: str
    path: Path
    seconds: float
    bytes_read: int
    bytes_by_source: dict[str, int]
    world_size: int
    saved_world_size: int
    skipped: tuple[tuple[int, str], ...] = ()

    @property
    def resharded(self) -> bool:
        return self.world_size != self.saved_world_size

# A single-process job passes no_dist=True on purpose; DCP warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized, assuming the intent is to", category=UserWarning)



class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_DATA_ERRORS = (IntegrityError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile)


def load_into(state: TrainState, ckpt_dir: Path, saved_world: int, comm: Comm, *,
              readers: int = 1, notes: list[str] | None = None, in_ram: bool = False) -> int:
    """Collective: load ``ckpt_dir`` (already verified) into ``state``; returns bytes read
    by this rank. ``readers``: how many ranks read this tier-1 root at once (its domain),
    who then read one stream each (a rank alone reads several); with ``in_ram`` (``ckpt_dir``
    on tier 0) it reads as memory is copied: ``RAM_STREAMS`` threads, ``RAM_PIECE`` pieces.
    Different world sizes reshard model/optimizer through DCP; per-rank state follows the
    semantics documented in :mod:`tierckpt.state`.

    On the saved world size a rank plans its reads from its own ``__<rank>.metadata``
    (size and CRC32C checked first) when that covers every tensor it loads (:func:`uncovered`),
    so the metadata it reads does not grow with the number of ranks; otherwise (a
    replicated tensor another rank wrote, a new layout, a checkpoint from before those
    files) from the global ``.metadata``. A damaged rank file is not an error: the reads
    are planned from ``.metadata`` and the reason is appended to ``notes``.

    Raises, on every rank: :class:`StateMismatchError` before anything is read when the
    state's keys or shapes differ from the checkpoint's (a user error: the checkpoint is
    fine); :class:`CorruptDataError` when the data fails while being read — each file's
    CRC32C is checked from the bytes read (:class:`DirectReader`), a record that does not
    unpickle counts too — after which ``state`` holds part of this checkpoint and must be
    loaded again (the manager falls back to the next older step). A ``.metadata`` that
    names a global outside DCP's metadata classes
    (:class:`~tierckpt.errors.UnsafeCheckpointError`) or does not unpickle is a
    :class:`CorruptDataError` too, raised on every rank before anything is loaded."""
    # alone on the disk: several streams; ranks sharing it: one each (theirs run in parallel
    # already; on the bench's disk 2 ranks x 1 restored 1.25-1.8x faster than 2 x 2 or 2 x 4)
    streams = RAM_STREAMS if in_ram else READ_STREAMS if readers <= 1 else 1
    md, target, reader, read_before = _plan_reads(state, ckpt_dir, saved_world, comm,
                                                  streams, notes)
    if in_ram:  # (the reader, whichever metadata it plans from, reads memory)
        reader.piece = RAM_PIECE
    mismatch = comm.first_error(_mismatches(state.tensors(), md))
    if mismatch:
        raise StateMismatchError(
            f"the state does not match checkpoint {ckpt_dir} ({mismatch}); nothing was "
            "loaded. Build the model (and optimizer) the checkpoint was saved from, or "
            "start a new tier1 directory")
    _load(target, reader, ckpt_dir, comm)
    try:
        state.load_state_dict(target)
    except (RuntimeError, KeyError, ValueError) as e:  # set_state_dict's strict checks
        raise StateMismatchError(f"the state does not match checkpoint {ckpt_dir}: {e}. The "
                                 "model's large tensors were already loaded from it") from e
    return read_before + reader.bytes_read


def _plan_reads(state: TrainState, ckpt_dir: Path, saved_world: int, comm: Comm,
                streams: int, notes: list[str] | None
                ) -> tuple[Metadata, dict[str, Any], DirectReader, int]:
    """Collective: the metadata ``load_into`` plans from, the load targets, the reader, and
    the bytes read through a reader that was replaced. This rank's own metadata when it
    covers every target (:func:`_plan_own`), else the global ``.metadata``; a refused
    metadata raises :class:`CorruptDataError` on every rank before anything is loaded."""
    same_world = saved_world == comm.world_size
    manifest = _rank_part(ckpt_dir, comm.rank, notes) if same_world else None
    partial = manifest is not None
    if manifest is None:
        manifest = read_committed(ckpt_dir, step=None).manifest
    entries, reader = _reader(ckpt_dir, manifest, streams)
    read_before = 0  # bytes read through a reader that was replaced
    src = comm.rank if same_world else comm.rank % saved_world
    md: Metadata | None = None
    target: dict[str, Any] | None = None
    bad: str | None = None
    if same_world and layout.rank_metadata_filename(comm.rank) in entries:
        md, target, bad = _plan_own(state, reader, src, comm.rank, notes)
    if target is None and bad is None:
        if partial:  # reads beyond this rank's files may follow: the whole manifest
            read_before = reader.bytes_read
            _, reader = _reader(ckpt_dir, read_committed(ckpt_dir, step=None).manifest,
                                streams)
        try:
            md = reader.read_metadata()
        except IntegrityError as e:  # UnsafeCheckpointError too: a planted pickle, not run
            md, bad = None, f"rank {comm.rank}: {e}"
    bad = comm.first_error(bad)  # node-local copies may differ
    if bad is not None:
        raise CorruptDataError(f"{ckpt_dir.name}: {bad} (nothing was loaded)")
    assert md is not None
    if target is None:
        blob_md: Any = md.state_dict_metadata.get(f"{RANK_STATE}.{src}")
        if blob_md is None:
            raise CheckpointError(f"checkpoint {ckpt_dir} has no per-rank state for rank {src}")
        target = state.load_targets(source_rank=src, blob_bytes=int(blob_md.size[0]))
    return md, target, reader, read_before


def _plan_own(state: TrainState, reader: DirectReader, src: int, rank: int,
              notes: list[str] | None
              ) -> tuple[Metadata | None, dict[str, Any] | None, str | None]:
    """The saved layout: plan from this rank's own metadata (O(1) in the world size).
    Returns (that metadata, the load targets when it covers them all, why the step is
    refused); a damaged file is noted and leaves all three None (plan from ``.metadata``)."""
    own = layout.rank_metadata_filename(rank)
    try:
        md = reader.read_metadata(rank=rank)
    except UnsafeCheckpointError as e:  # planted, not damaged: the step is refused
        return None, None, f"rank {rank}: {e}"
    except IntegrityError as e:
        if notes is not None:
            notes.append(f"{own} is damaged, so the reads were planned from "
                         f"{layout.METADATA} ({e})")
        return None, None, None
    blob: Any = md.state_dict_metadata.get(f"{RANK_STATE}.{src}")
    if not isinstance(blob, TensorStorageMetadata):
        return md, None, None
    target = state.load_targets(source_rank=src, blob_bytes=int(blob.size[0]))
    if uncovered(target, md) is not None:  # items another rank wrote (a replicated
        return md, None, None  # tensor), or a new layout
    reader.metadata_rank = rank
    return md, target, None


def _load(target: dict[str, Any], reader: DirectReader, ckpt_dir: Path, comm: Comm) -> None:
    """Collective: DCP-load ``target`` through ``reader``; a failure on any rank raises on
    every rank (:class:`CorruptDataError` when the bytes are bad, else
    :class:`CheckpointError`). No central plan: DCP's global load plan changes nothing
    (every rank plans its reads from the metadata it read), so each rank loads alone and
    one flag says whether all did."""
    failure: BaseException | None = None
    err: tuple[bool, str] | None = None  # (the data is bad, why)
    try:
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        failure = e
        data = _data_error(e)
        err = (True, f"rank {comm.rank}: {data}") if data is not None else \
            (False, f"rank {comm.rank}: loading {ckpt_dir} failed: {e}")
    agreed = comm.first_error(err)
    if agreed is not None:
        bad_data, why = agreed
        if bad_data:
            raise CorruptDataError(f"{ckpt_dir.name}: {why} (the state was partly "
                                   "overwritten and must be loaded again)") from failure
        raise CheckpointError(why) from failure


def _rank_part(ckpt_dir: Path, rank: int, notes: list[str] | None) -> Manifest | None:
    """``rank``'s verified manifest part (O(1) entries), or None: a checkpoint from before
    the parts, or a part that fails its check (noted; the whole manifest is read)."""
    try:
        return read_part(ckpt_dir, rank)
    except IntegrityError as e:
        if notes is not None:
            notes.append(f"{layout.part_filename(rank)}: {e}, so the whole "
                         f"{layout.MANIFEST} was read")
        return None


def _reader(ckpt_dir: Path, manifest: Manifest, streams: int
            ) -> tuple[dict[str, FileEntry], DirectReader]:
    entries = {f.name: f for f in manifest.files}
    return entries, DirectReader(ckpt_dir, verify=entries, threads=streams,
                                 chunks=directory_chunks(ckpt_dir, manifest))


def uncovered(target: dict[str, Any], md: Metadata) -> str | None:
    """Why ``md`` (one rank's own metadata) cannot plan every read of ``target`` alone, or
    None when it can: every non-empty local chunk of every tensor must be one of ``md``'s
    chunks, same offsets and sizes, with its storage in ``md`` (so DCP's planner finds
    each byte it loads there, and nothing is silently left unread)."""
    flat, _ = flatten_state_dict(target)
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            return f"{fqn}: not a tensor"
        saved = md.state_dict_metadata.get(fqn)
        if not isinstance(saved, TensorStorageMetadata) or \
                tuple(saved.size) != tuple(value.size()):
            return f"{fqn}: not in this rank's metadata with this shape"
        chunks = {tuple(c.offsets): tuple(c.sizes) for c in saved.chunks}
        for local in create_chunk_list(value):
            if math.prod(local.sizes) == 0:
                continue
            if chunks.get(tuple(local.offsets)) != tuple(local.sizes) or \
                    MetadataIndex(fqn, local.offsets) not in md.storage_data:
                return f"{fqn}: chunk at {tuple(local.offsets)} written by another rank"
    return None


def _mismatches(target: dict[str, Any], md: Any) -> str | None:
    """The first few keys of ``target`` the checkpoint lacks or holds with another shape."""
    flat, _ = flatten_state_dict(target)
    saved = md.state_dict_metadata
    bad = []
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        if fqn not in saved:
            bad.append(f"{fqn}: not in the checkpoint")
        elif isinstance(saved[fqn], TensorStorageMetadata) and \
                tuple(saved[fqn].size) != tuple(value.shape):
            bad.append(f"{fqn}: checkpoint {tuple(saved[fqn].size)}, state {tuple(value.shape)}")
    if not bad:
        return None
    return "; ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def _data_error(e: BaseException) -> str | None:
    """Why ``e`` (a DCP CheckpointException from some rank, or a direct error) means the
    checkpoint's bytes are bad — or None when it does not."""
    failures = getattr(e, "failures", None)
    excs = [exc for exc, _ in failures.values()] if isinstance(failures, dict) else [e]
    for exc in excs:
        if isinstance(exc, _DATA_ERRORS) or (
                isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc)):
            return f"{type(exc).__name__}: {exc}"
    return None
