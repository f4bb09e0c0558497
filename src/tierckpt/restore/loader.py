"""Load a verified tier-1 checkpoint into a :class:`~tierckpt.state.TrainState` with DCP,
resharding when the world size changed, and what a restore reports (:class:`RestoreInfo`)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from tierckpt.errors import CheckpointError
from tierckpt.restore.reader import DirectReader
from tierckpt.runtime.topology import Comm
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


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_into(state: TrainState, ckpt_dir: Path, saved_world: int, comm: Comm) -> int:
    """Collective: load ``ckpt_dir`` (already verified) into ``state``; returns bytes read
    by this rank. Different world sizes reshard model/optimizer through DCP; per-rank state
    follows the semantics documented in :mod:`tierckpt.state`."""
    reader = DirectReader(ckpt_dir)
    md = reader.read_metadata()
    src = comm.rank if saved_world == comm.world_size else comm.rank % saved_world
    key = f"{RANK_STATE}.{src}"
    blob_md: Any = md.state_dict_metadata.get(key)
    if blob_md is None:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no per-rank state for rank {src}")
    target = state.load_targets(source_rank=src, blob_bytes=int(blob_md.size[0]))
    try:
        dcp.load(target, storage_reader=reader, planner=_SafeLoadPlanner(),
                 process_group=comm.group, no_dist=comm.group is None)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"rank {comm.rank}: loading {ckpt_dir} failed: {e}") from e
    state.load_state_dict(target)
    return reader.bytes_read
