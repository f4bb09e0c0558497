"""Discover, verify and choose what to restore; load it, resharding if the world changed.

Choosing is a collective over domain owners (see ``_topology``): each owner proposes the
newest step that verifies in its own tier-1 root at or below a bound; the bound drops to
the smallest proposal until every owner proposes the same step. A candidate that fails
verification is moved to ``quarantine/`` with its reason (never deleted) and logged, and
the next older one is tried. Nothing a manifest names — DCP's pickled ``.metadata``
included — is opened before the marker, manifest and file sizes (or CRC32C) check out.
"""

from __future__ import annotations

import dataclasses
import io
import os
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from tierckpt import _crc, _fs, events, layout
from tierckpt import manifest as mf
from tierckpt._topology import Comm
from tierckpt.errors import CheckpointError, IntegrityError
from tierckpt.state import RANK_STATE, TrainState


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


def complete_steps(root: Path) -> list[int]:
    """Steps of final-named directories under ``root`` that have a COMPLETE file, newest
    first (no verification: for retention and ``ls``)."""
    out = []
    for e in os.scandir(root):
        step = layout.parse_step_dirname(e.name)
        if step is not None and e.is_dir(follow_symlinks=False) and \
                os.path.exists(os.path.join(e.path, layout.COMPLETE)):
            out.append(step)
    return sorted(out, reverse=True)


def candidate_steps(root: Path) -> list[int]:
    """Every final-named entry under ``root``, newest first (complete or not)."""
    steps = [layout.parse_step_dirname(n) for n in os.listdir(root)]
    return sorted((s for s in steps if s is not None), reverse=True)


def verify_checkpoint(ckpt_dir: Path, *, step: int | None = None,
                      ranks: set[int] | None = None, full: bool = False) -> mf.Manifest:
    """Verify one tier-1 checkpoint directory; return its manifest or raise
    :class:`IntegrityError` with the reason. ``ranks``: only the files of these ranks (and
    shared files) must be present (a node-local domain); None means every file."""
    st = os.lstat(ckpt_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise IntegrityError(f"{ckpt_dir.name} is not a directory (symlink or file)")
    try:
        marker = _read_small(ckpt_dir / layout.COMPLETE)
    except FileNotFoundError:
        raise IntegrityError("no COMPLETE marker (the save never committed)") from None
    try:
        mbytes = _read_small(ckpt_dir / layout.MANIFEST)
    except FileNotFoundError:
        raise IntegrityError("COMPLETE present but manifest.json missing") from None
    m = mf.verify_marker(marker, mbytes, mf.signing_key())
    if step is not None and m.step != step:
        raise IntegrityError(f"directory is named for step {step} but its manifest is step "
                             f"{m.step} (renamed by hand?)")
    wanted = m.files if ranks is None else m.files_for_ranks(ranks)
    for f in wanted:
        p = ckpt_dir / layout.safe_member_name(f.name)
        try:
            fst = os.lstat(p)
        except FileNotFoundError:
            raise IntegrityError(f"{f.name} is missing") from None
        if not stat.S_ISREG(fst.st_mode):
            raise IntegrityError(f"{f.name} is not a regular file")
        if fst.st_size != f.size:
            raise IntegrityError(f"{f.name} has {fst.st_size} bytes, manifest says {f.size}")
        if full:
            crc, _ = _crc.of_file(p)
            if crc != f.crc32c:
                raise IntegrityError(f"{f.name} CRC32C {_crc.to_hex(crc)} != manifest "
                                     f"{_crc.to_hex(f.crc32c)}")
    return m


def _read_small(p: Path, limit: int = 64 << 20) -> bytes:
    with open(p, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise IntegrityError(f"{p.name} is larger than {limit} bytes")
    return data


class Chooser:
    """Agrees with every domain owner on the newest step that verifies everywhere."""

    def __init__(self, root: Path, comm: Comm, domain: tuple[int, ...], *, is_owner: bool,
                 full: bool, log: events.EventLog) -> None:
        self.root, self.comm, self.domain = root, comm, domain
        self.is_owner, self.full, self.log = is_owner, full, log
        self.skipped: list[tuple[int, str]] = []
        self._ok: dict[int, mf.Manifest] = {}

    def _newest_valid(self, bound: float) -> int | None:
        for step in candidate_steps(self.root):
            if step > bound:
                continue
            if step in self._ok:
                return step
            d = self.root / layout.step_dirname(step)
            try:
                self._ok[step] = verify_checkpoint(d, step=step, ranks=None, full=self.full)
                return step
            except (IntegrityError, OSError) as e:
                reason = str(e)
                moved = _fs.move_aside(d, self.root / layout.QUARANTINE, d.name)
                (moved / "QUARANTINE_REASON").write_text(reason + "\n")
                self.skipped.append((step, reason))
                self.log.emit(events.CHECKPOINT_SKIPPED, step=step, reason=reason,
                              moved_to=str(moved))
        return None

    def choose(self) -> int | None:
        """Collective. The agreed step, or None when no domain has any checkpoint.
        Raises CheckpointError when some domains have checkpoints and others have none."""
        bound: float = float("inf")
        while True:
            proposal = self._newest_valid(bound) if self.is_owner else "n/a"
            props = [p for p in self.comm.all_gather(proposal) if p != "n/a"]
            if all(p is None for p in props):
                return None
            if any(p is None for p in props):
                raise CheckpointError(
                    "some tier-1 roots have a complete checkpoint and others have none "
                    f"(proposals per domain: {props}); a replaced node needs tier 2 to restore")
            low = min(props)
            if all(p == low for p in props):
                return int(low)
            bound = low


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _CountingReader(FileSystemReader):
    """FileSystemReader that counts the bytes its plans read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.bytes_read += sum(self.storage_data[i.storage_index].length for i in plan.items)
        return super().read_data(plan, planner)


def load_into(state: TrainState, ckpt_dir: Path, saved_world: int, comm: Comm) -> int:
    """Collective: load ``ckpt_dir`` (already verified) into ``state``; returns bytes read
    by this rank. Different world sizes reshard model/optimizer through DCP; per-rank state
    follows the semantics documented in :mod:`tierckpt.state`."""
    reader = _CountingReader(ckpt_dir)
    md = reader.read_metadata()
    src = comm.rank if saved_world == comm.world_size else comm.rank % saved_world
    key = f"{RANK_STATE}.{src}"
    blob_md: Any = md.state_dict_metadata.get(key)
    if blob_md is None:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no per-rank state for rank {src}")
    state._load_source = (src, int(blob_md.size[0]), saved_world)
    try:
        target = state.state_dict()
    finally:
        state._load_source = None
    try:
        dcp.load(target, storage_reader=reader, planner=_SafeLoadPlanner(),
                 process_group=comm.group, no_dist=comm.group is None)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"rank {comm.rank}: loading {ckpt_dir} failed: {e}") from e
    state.load_state_dict(target)
    return reader.bytes_read

