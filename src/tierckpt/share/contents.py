"""What a checkpoint holds, from its (verified, restricted-unpickled) metadata alone: every
entry's shape, dtype and bytes, the files that hold it, and totals per top-level key.
Nothing but the marker, manifest and ``.metadata`` is read."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tierckpt.format import layout
from tierckpt.share.source import Checkpoint


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of the checkpoint. ``bytes`` is the logical size (elements × element
    size; for a bytes entry, its record); ``stored`` the records' size on disk."""

    name: str
    key: str
    shape: tuple[int, ...] | None
    dtype: str
    bytes: int
    stored: int
    chunks: int
    files: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key,
                "shape": list(self.shape) if self.shape is not None else None,
                "dtype": self.dtype, "bytes": self.bytes, "stored_bytes": self.stored,
                "chunks": self.chunks, "files": list(self.files)}


@dataclasses.dataclass(frozen=True)
class Contents:
    """A checkpoint's entries, and totals per top-level key."""

    step: int
    location: str
    world_size: int
    checkpoint_bytes: int
    entries: tuple[Entry, ...]
    has_chunk_crcs: bool

    def totals(self) -> dict[str, dict[str, int]]:
        """``{key: {"entries", "bytes", "stored_bytes"}}`` in key order."""
        out: dict[str, dict[str, int]] = {}
        for e in self.entries:
            t = out.setdefault(e.key, {"entries": 0, "bytes": 0, "stored_bytes": 0})
            t["entries"] += 1
            t["bytes"] += e.bytes
            t["stored_bytes"] += e.stored
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "location": self.location, "world_size": self.world_size,
                "checkpoint_bytes": self.checkpoint_bytes,
                "per_record_crc32c": self.has_chunk_crcs, "totals": self.totals(),
                "entries": [e.to_json() for e in self.entries]}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def contents(ckpt: Checkpoint) -> Contents:
    """The entries of ``ckpt`` (sorted by name)."""
    md: Metadata = ckpt.metadata()
    storage = md.storage_data
    per_name: dict[str, list[Any]] = {}
    for index, info in storage.items():
        per_name.setdefault(index.fqn, []).append(info)
    entries = []
    for fqn, entry in sorted(md.state_dict_metadata.items()):
        infos = per_name.get(fqn, [])
        stored = sum(i.length for i in infos)
        files = tuple(sorted({i.relative_path for i in infos}))
        key = fqn.split(".", 1)[0]
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            n = math.prod(entry.size)
            entries.append(Entry(name=fqn, key=key, shape=tuple(entry.size),
                                 dtype=dtype_name(dtype),
                                 bytes=n * torch.empty((), dtype=dtype).element_size(),
                                 stored=stored, chunks=len(entry.chunks), files=files))
        else:
            entries.append(Entry(name=fqn, key=key, shape=None, dtype="bytes", bytes=stored,
                                 stored=stored, chunks=len(infos), files=files))
    chunked = all(ckpt.chunk_index.has_chunks(f.name) for f in ckpt.manifest.files
                  if layout.shard_rank(f.name) is not None)
    return Contents(step=ckpt.step, location=ckpt.location,
                    world_size=ckpt.manifest.world_size,
                    checkpoint_bytes=ckpt.manifest.total_bytes, entries=tuple(entries),
                    has_chunk_crcs=chunked)

