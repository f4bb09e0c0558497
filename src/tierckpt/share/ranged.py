"""Read only the records a load needs, each verified before use: a DCP ``StorageReader``
over :class:`~tierckpt.share.source.Checkpoint`'s byte ranges, and whole-tensor assembly
for export.

Every DCP item (one tensor chunk or bytes blob) is one ``torch.save`` record at
``(file, offset, length)`` in ``.metadata``'s storage data. The reader fetches just those
ranges — ranged GETs on S3, ``preadv`` locally — several at once, and checks each against
its manifest chunk CRC32C (:class:`~tierckpt.format.manifest.Chunk`) before it is
unpickled (``weights_only=True``) and copied into the destination. A file whose manifest
entry has no chunks (written before tierckpt recorded them), or every file with
``verify="files"``, is read whole once and checked against the file CRC32C instead; the
reader notes which files were (:attr:`RangedReader.whole_files`).

A mismatch raises :class:`~tierckpt.errors.CorruptDataError` naming the file, the range
and the tensor; the destination may then hold part of the checkpoint.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt.errors import ConfigError, CorruptDataError
from tierckpt.format import checksum
from tierckpt.share.source import Checkpoint

VerifyMode = Literal["chunks", "files"]
_WINDOW = 8  # records in flight at once (bounds memory to ~8 records)


class RecordFetcher:
    """Fetches records of one checkpoint, verified; thread-safe."""

    def __init__(self, ckpt: Checkpoint, *, verify: VerifyMode = "chunks",
                 threads: int = 8) -> None:
        if verify not in ("chunks", "files"):
            raise ConfigError(f"verify must be 'chunks' or 'files', got {verify!r}")
        self.ckpt, self.verify, self.threads = ckpt, verify, max(1, threads)
        self.whole_files: set[str] = set()
        """Files read whole (no chunk CRCs, or ``verify="files"``)."""
        self.chunks_verified = 0
        self._whole: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def fetch(self, info: _StorageInfo, what: str) -> bytes:
        """The record ``info`` (``what`` names it in errors), verified."""
        entry = self.ckpt.entry(info.relative_path)
        chunk = entry.chunk(info.offset, info.length) if self.verify == "chunks" else None
        if chunk is None:
            data = self._whole_file(info.relative_path)
            return data[info.offset:info.offset + info.length]
        data = self.ckpt.read_range(info.relative_path, info.offset, info.length)
        if checksum.extend(0, data) != chunk.crc32c:
            raise CorruptDataError(
                f"{self.ckpt.location}/{info.relative_path}: bytes {info.offset}+{info.length} "
                f"({what}) do not match their CRC32C {checksum.to_hex(chunk.crc32c)} in the "
                "manifest (damaged in storage or in transit); nothing of this record was used")
        with self._lock:
            self.chunks_verified += 1
        return data

    def _whole_file(self, name: str) -> bytes:
        """File ``name`` read whole and checked against its CRC32C; the last one is kept
        (records are fetched in file order), so each file is read once."""
        with self._lock:
            if name in self._whole:
                return self._whole[name]
            data = self.ckpt.read_whole(name)  # under the lock: one read per file
            self._whole = {name: data}
            self.whole_files.add(name)
            return data

    def fetch_many(self, jobs: Iterable[tuple[_StorageInfo, str]]
                   ) -> Iterator[tuple[_StorageInfo, bytes]]:
        """Fetch several records in parallel (at most a few in flight), yielding them in
        the order given."""
        pending: list[tuple[_StorageInfo, CFuture[bytes]]] = []
        with ThreadPoolExecutor(self.threads, thread_name_prefix="tierckpt-fetch") as pool:
            for info, what in jobs:
                pending.append((info, pool.submit(self.fetch, info, what)))
                if len(pending) >= max(_WINDOW, self.threads):
                    info0, fut = pending.pop(0)
                    yield info0, fut.result()
            for info0, fut in pending:
                yield info0, fut.result()


def load_record(data: bytes) -> torch.Tensor:
    """A tensor record's tensor (``weights_only``: plain tensors, no code)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class RangedReader(StorageReader):
    """DCP ``StorageReader`` for :func:`torch.distributed.checkpoint.load` over a
    :class:`Checkpoint`: reads only the planned items' records, each verified."""

    def __init__(self, ckpt: Checkpoint, *, verify: VerifyMode = "chunks",
                 threads: int = 8) -> None:
        super().__init__()
        self.fetcher = RecordFetcher(ckpt, verify=verify, threads=threads)
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.load_id: str | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.load_id = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self.fetcher.ckpt.metadata()
        meta = md.storage_meta if md.storage_meta is not None else StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptDataError(f"{self.fetcher.ckpt.location}: .metadata has no storage "
                                   "data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        by_record: dict[tuple[str, int, int], list[ReadItem]] = {}
        infos: dict[tuple[str, int, int], _StorageInfo] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if info.transform_descriptors:
                raise ConfigError(f"{item.storage_index.fqn} is stored with transforms "
                                  f"{info.transform_descriptors}; this reader does not apply "
                                  "them")
            key = (info.relative_path, info.offset, info.length)
            by_record.setdefault(key, []).append(item)
            infos[key] = info
        order = sorted(infos)  # file order: sequential ranges per file
        jobs = [(infos[k], by_record[k][0].storage_index.fqn) for k in order]
        for info, data in self.fetcher.fetch_many(jobs):
            for item in by_record[(info.relative_path, info.offset, info.length)]:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(data))
                    continue
                tensor = narrow_tensor_by_index(load_record(data), item.storage_offsets,
                                                item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise CorruptDataError(f"{item.storage_index.fqn}: record holds "
                                           f"{tuple(tensor.size())}, expected "
                                           f"{tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str:
        return self.fetcher.ckpt.location

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def assemble(fetcher: RecordFetcher, fqn: str, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """The whole tensor ``fqn`` from all of its saved chunks (any world size), into
    ``out`` (allocated when None): one tensor in memory plus one record at a time."""
    md = fetcher.ckpt.metadata()
    entry = md.state_dict_metadata.get(fqn)
    if not isinstance(entry, TensorStorageMetadata):
        raise ConfigError(f"{fqn!r} is not a tensor of {fetcher.ckpt.location}")
    if out is None:
        out = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    storage = md.storage_data
    jobs = [(storage[MetadataIndex(fqn, tuple(c.offsets))], fqn) for c in entry.chunks]
    for chunk, (_info, data) in zip(entry.chunks, fetcher.fetch_many(jobs), strict=True):
        part = load_record(data)
        view = out
        for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            view = view.narrow(dim, o, n)
        if view.shape != part.shape:
            raise CorruptDataError(f"{fqn}: chunk at {tuple(chunk.offsets)} holds "
                                   f"{tuple(part.shape)}, expected {tuple(view.shape)}")
        view.copy_(part)
    return out
