"""The synthetic Llama-70B state of ``bench.scale_synth``: what each of W ranks would plan
and write, built item by item, with no tensors and no ranks.

The state (:data:`LAYER`, 80 layers × 9 tensors = 720 parameters, fp32, each with AdamW's
``exp_avg`` and ``exp_avg_sq`` and a scalar ``step``; one param group; the per-rank blob
``rank_state.<r>``) is what ``tierckpt.TrainState`` hands DCP for an FSDP2 model: every
parameter and moment sharded along dim 0 with ``torch.chunk``'s rule (ranks past the end
hold an empty shard at offset = the dim's size, as DTensor gives them), ``step`` and the
param group's values replicated on every rank. Each rank's ``SavePlan``
(:func:`local_plan`) is built as ``create_default_local_save_plan`` would (``WriteItem``,
``MetadataIndex``, ``ChunkStorageMetadata``, the flattening's ``planner_data``);
:func:`written` is what a rank reports after writing it.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt.format import manifest as mf

LAYERS = 80
DIM, KV, FFN = 8192, 1024, 28672
LAYER: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("attention.wq.weight", (DIM, DIM)), ("attention.wk.weight", (KV, DIM)),
    ("attention.wv.weight", (KV, DIM)), ("attention.wo.weight", (DIM, DIM)),
    ("feed_forward.w1.weight", (FFN, DIM)), ("feed_forward.w2.weight", (DIM, FFN)),
    ("feed_forward.w3.weight", (FFN, DIM)), ("attention_norm.weight", (DIM,)),
    ("ffn_norm.weight", (DIM,)))
"""One Llama-3-70B decoder layer (dim 8192, 8 KV heads of 128, FFN 28672)."""
MOMENTS = ("exp_avg", "exp_avg_sq")
PARAM_GROUP = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
               "capturable", "differentiable", "fused", "decoupled_weight_decay", "params")
BLOB_BYTES = 18_269
"""The per-rank blob (RNG streams, step) as measured in the real runs."""
RECORD_OVERHEAD = 1_088
"""Bytes a shard file's record adds to its tensor's data (``torch.save``'s zip framing)."""


def _shard(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s dim-0 shard of ``n`` rows (``torch.chunk``'s rule)."""
    c = -(-n // world)
    start = min(rank * c, n)
    length = max(0, min(n, start + c) - start)
    return (start if length else n), length


def _item(fqn: str, size: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
          kind: WriteItemType, dtype: torch.dtype = torch.float32) -> WriteItem:
    off = torch.Size(offsets)
    return WriteItem(index=MetadataIndex(fqn, off), type=kind, tensor_data=TensorWriteData(
        chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(sizes)),
        properties=TensorProperties(dtype=dtype), size=torch.Size(size)))


def _layer_indices(layers: int) -> list[int]:
    """Which of the 80 layers a point builds: spread out, so that its names have the
    full state's mix of one- and two-digit layer numbers (their pickled sizes differ)."""
    return [k * LAYERS // layers for k in range(layers)]


def local_plan(rank: int, world: int, layers: int) -> SavePlan:
    """Rank ``rank``'s ``SavePlan`` for ``layers`` layers of the 70B state, as the default
    local planner builds it (``planner_data``: the flattening's fqn → path)."""
    items: list[WriteItem] = []
    paths: dict[str, tuple[str, ...]] = {}
    for i in _layer_indices(layers):
        for name, shape in LAYER:
            off, length = _shard(shape[0], world, rank)
            offsets, sizes = (off, *(0,) * (len(shape) - 1)), (length, *shape[1:])
            key = f"layers.{i}.{name}"
            items.append(_item(f"model.{key}", shape, offsets, sizes, WriteItemType.SHARD))
            paths[f"model.{key}"] = ("model", key)
            for m in MOMENTS:
                fqn = f"optim.state.{key}.{m}"
                items.append(_item(fqn, shape, offsets, sizes, WriteItemType.SHARD))
                paths[fqn] = ("optim", "state", key, m)
            fqn = f"optim.state.{key}.step"
            items.append(_item(fqn, (), (), (), WriteItemType.TENSOR))
            paths[fqn] = ("optim", "state", key, "step")
    for k in PARAM_GROUP:
        fqn = f"optim.param_groups.0.{k}"
        items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        paths[fqn] = ("optim", "param_groups", "0", k)
    blob = f"rank_state.{rank}"
    items.append(_item(blob, (BLOB_BYTES,), (0,), (BLOB_BYTES,), WriteItemType.TENSOR,
                       torch.uint8))
    paths[blob] = ("rank_state", str(rank))
    return SavePlan(items, planner_data=paths)


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 420  # a pickled param-group value
    return math.prod(item.tensor_data.chunk.sizes) * \
        torch._utils._element_size(item.tensor_data.properties.dtype)


def written(rank: int, plan: SavePlan, stretch: float = 1.0
            ) -> tuple[list[WriteResult], mf.FileEntry]:
    """What rank ``rank`` reports after writing ``plan`` into one file: DCP's write results
    and tierckpt's ``FileEntry`` (a CRC ``Chunk`` per record).

    Offsets and the file's size are multiplied by ``stretch`` (80 / layers built): in the
    full state they run to the whole shard's size, and their digits (JSON) and pickled
    widths are part of every size measured here."""
    name, offset = f"__{rank}_0.distcp", 0
    results, chunks = [], []
    for item in plan.items:
        length = _nbytes(item) + RECORD_OVERHEAD
        crc = zlib.crc32(item.index.fqn.encode())
        at = round(offset * stretch)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(name, at, length)))
        chunks.append(mf.Chunk(at, length, crc))
        offset += length
    return results, mf.FileEntry(name=name, size=round(offset * stretch), crc32c=rank,
                                 rank=rank, chunks=tuple(chunks))
