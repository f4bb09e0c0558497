"""Read only the records a load needs, each verified before use: a DCP ``StorageReader``
over :class:`~tierckpt.share.source.Checkpoint`'s byte ranges, and whole-tensor assembly
for export.

Every DCP item (one tensor chunk or bytes blob) is one ``torch.save`` record at
``(file, offset, length)`` in ``.metadata``'s storage data. A :class:`SpanReader` is given
the records a job will use, in the order it will use them; records next to each other in a
file (gap at most ``GAP``) are merged into one *span*, fetched with one ranged GET (S3) or
``preadv`` (local) — several spans at once, at most ``WINDOW`` bytes ahead of the consumer.
Each record is checked against its own manifest CRC32C (a
:class:`~tierckpt.format.manifest.Chunk`) on its slice of the span before it is decoded
(``weights_only``: plain tensors, no code) into the destination. A file whose manifest entry
has no chunks (written before tierckpt recorded them), or every file with
``verify="files"``, is read whole once and checked against the file CRC32C instead
(:attr:`RecordFetcher.whole_files`).

A mismatch raises :class:`~tierckpt.errors.CorruptDataError` naming the file, the range
and the tensor; the destination may then hold part of the checkpoint.
"""

from __future__ import annotations

import enum
import io
import sys
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt._torch.dcp import StorageInfo, narrow_tensor_by_index
from tierckpt.errors import ConfigError, CorruptDataError
from tierckpt.format import checksum
from tierckpt.format.torchzip import tensor_data_offset
from tierckpt.policy.checks import check_enum
from tierckpt.share.source import Checkpoint


class ReadCheck(str, enum.Enum):
    """How :func:`tierckpt.load` and ``tierckpt export`` check what they read (every byte
    they use is checked either way; this is not :class:`~tierckpt.Verify`, which chooses
    how much of a checkpoint a restore checks before it reads).

    ``CHUNKS`` (default): each record against its own CRC32C, so only the records asked
    for are read. ``FILES``: whole files, each against its file CRC32C.
    """

    CHUNKS = "chunks"
    FILES = "files"


VerifyMode = ReadCheck | Literal["chunks", "files"]
GAP = 256 * 1024
"""Records at most this far apart in a file are fetched as one span (the gap is read too)."""
SPAN_MAX = 32 * 1024 * 1024
WINDOW = 128 * 1024 * 1024
"""Bytes fetched ahead of the consumer (bounds a load's or export's extra memory)."""

Key = tuple[str, int, int]


def _key(info: StorageInfo) -> Key:
    return (info.relative_path, info.offset, info.length)


class RecordFetcher:
    """Fetches spans of one checkpoint on a thread pool kept for its lifetime; checks
    records. Close it (or use ``with``)."""

    def __init__(self, ckpt: Checkpoint, *, verify: VerifyMode = "chunks",
                 threads: int = 8) -> None:
        self.ckpt, self.verify = ckpt, check_enum("verify", ReadCheck, verify)
        self.whole_files: set[str] = set()
        """Files read whole (no chunk CRCs, or ``verify="files"``)."""
        self.chunks_verified = 0
        self._whole: dict[str, memoryview] = {}
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="tierckpt-fetch")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RecordFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chunked(self, name: str) -> bool:
        """Whether file ``name``'s records can be checked one by one."""
        return self.verify is ReadCheck.CHUNKS and bool(self.ckpt.entry(name).chunks)

    def read_span(self, name: str, offset: int, length: int) -> memoryview:
        return memoryview(self.ckpt.read_range(name, offset, length))

    def whole_file(self, name: str) -> memoryview:
        """File ``name`` read whole and checked against its CRC32C; the last one is kept
        (records are read in file order), so each file is normally read once."""
        with self._lock:
            if name in self._whole:
                return self._whole[name]
            data = memoryview(self.ckpt.read_whole(name))  # under the lock: one read
            self._whole = {name: data}
            self.whole_files.add(name)
            return data

    def check(self, info: StorageInfo, data: memoryview, what: str) -> memoryview:
        """``data`` (the record ``info``), verified against its chunk CRC32C."""
        self.ckpt.entry(info.relative_path)  # IntegrityError for a file it does not list
        chunk = self.ckpt.chunk_index.record(info.relative_path, info.offset, info.length)
        if chunk is None:
            raise CorruptDataError(f"{self.ckpt.location}/{info.relative_path}: the manifest "
                                   f"lists no record at {info.offset}+{info.length} ({what}); "
                                   ".metadata and manifest disagree")
        if checksum.extend(0, data) != chunk.crc32c:
            raise CorruptDataError(
                f"{self.ckpt.location}/{info.relative_path}: bytes {info.offset}+{info.length} "
                f"({what}) do not match their CRC32C {checksum.to_hex(chunk.crc32c)} in the "
                "manifest (damaged in storage or in transit); nothing of this record was used")
        with self._lock:
            self.chunks_verified += 1
        return data


class SpanReader:
    """The records of one job, planned up front: :meth:`get` returns each one's bytes,
    verified. Spans (at most ``window`` bytes each) are fetched in plan order, up to
    ``window`` bytes ahead; a span is released once every record in it was taken (each
    planned record is taken once)."""

    def __init__(self, fetcher: RecordFetcher,
                 plan: Sequence[tuple[StorageInfo, str]], *, window: int = WINDOW) -> None:
        self.fetcher = fetcher
        self.window = max(1, window)
        span_max = min(SPAN_MAX, self.window)
        self._spans: list[tuple[str, int, int]] = []
        self._of: dict[Key, int] = {}
        self._what: dict[Key, str] = {}
        self._left: list[int] = []
        for info, what in plan:
            k = _key(info)
            if k in self._of:
                continue
            self._what[k] = what
            name, off, n = k
            last = self._spans[-1] if self._spans else None
            if (last is not None and last[0] == name and fetcher.chunked(name)
                    and 0 <= off - (last[1] + last[2]) <= GAP
                    and off + n - last[1] <= span_max):
                self._spans[-1] = (name, last[1], off + n - last[1])
                self._left[-1] += 1
            else:
                self._spans.append((name, off, n))
                self._left.append(1)
            self._of[k] = len(self._spans) - 1
        self._futures: dict[int, CFuture[memoryview]] = {}
        self._next = 0
        self._ahead = 0
        self._lock = threading.Lock()

    def _fill(self) -> None:
        """Submit spans in order while less than WINDOW bytes are in flight or waiting."""
        while self._next < len(self._spans) and (self._ahead < self.window
                                                 or not self._futures):
            self._submit(self._next)
            self._next += 1

    def _submit(self, i: int) -> None:
        if i in self._futures:
            return
        name, off, n = self._spans[i]
        f = self.fetcher
        fut = f.pool.submit(f.read_span, name, off, n) if f.chunked(name) else \
            f.pool.submit(f.whole_file, name)
        self._futures[i] = fut
        self._ahead += n

    def get(self, info: StorageInfo) -> memoryview:
        """The verified bytes of record ``info`` (which must be in the plan)."""
        k = _key(info)
        with self._lock:
            i = self._of[k]
            self._fill()
            self._submit(i)  # asked out of order: fetch it now
            fut = self._futures[i]
        data = fut.result()
        name, off, _n = self._spans[i]
        with self._lock:
            self._left[i] -= 1
            if self._left[i] == 0:  # every record of the span taken: release it
                del self._futures[i]
                self._ahead -= self._spans[i][2]
        if not self.fetcher.chunked(name):
            return data[info.offset:info.offset + info.length]
        record = data[info.offset - off:info.offset - off + info.length]
        return self.fetcher.check(info, record, self._what[k])


def record_tensor(data: memoryview, dtype: torch.dtype, shape: Sequence[int]
                  ) -> torch.Tensor:
    """The tensor in a ``torch.save`` record, as a view of ``data`` when the record holds
    exactly one uncompressed storage of ``shape`` × ``dtype`` (how tierckpt writes every
    tensor: a contiguous staging buffer that owns its storage), else ``torch.load``
    (``weights_only``) of it."""
    nbytes = 1
    for s in shape:
        nbytes *= s
    nbytes *= torch.empty((), dtype=dtype).element_size()
    if sys.byteorder == "little" and nbytes > 0:
        start = tensor_data_offset(lambda off, n: data[off:off + n], len(data), nbytes)
        if start is not None:
            with warnings.catch_warnings():  # read-only bytes: only ever read from
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(data[start:start + nbytes],
                                        dtype=dtype).view(tuple(shape))
    return load_record(data)


def load_record(data: memoryview | bytes) -> torch.Tensor:
    """A tensor record's tensor (``weights_only``: plain tensors, no code)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class RangedReader(StorageReader):
    """DCP ``StorageReader`` for :func:`torch.distributed.checkpoint.load` over a
    :class:`Checkpoint`: reads only the planned items' records, each verified."""

    def __init__(self, ckpt: Checkpoint, *, verify: VerifyMode = "chunks",
                 threads: int = 8) -> None:
        super().__init__()
        self.fetcher = RecordFetcher(ckpt, verify=verify, threads=threads)
        self.storage_data: dict[MetadataIndex, StorageInfo] = {}
        self.load_id: str | None = None
        self._dtypes: dict[str, torch.dtype] = {}

    def close(self) -> None:
        self.fetcher.close()

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
        self._dtypes = {fqn: md.properties.dtype
                        for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:

        by_record: dict[Key, list[ReadItem]] = {}
        infos: dict[Key, StorageInfo] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if info.transform_descriptors:
                raise ConfigError(f"{item.storage_index.fqn} is stored with transforms "
                                  f"{info.transform_descriptors}; this reader does not apply "
                                  "them")
            by_record.setdefault(_key(info), []).append(item)
            infos[_key(info)] = info
        order = sorted(infos)  # file order: adjacent records merge into spans
        spans = SpanReader(self.fetcher,
                           [(infos[k], by_record[k][0].storage_index.fqn) for k in order])
        for k in order:
            data = spans.get(infos[k])
            for item in by_record[k]:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(data))
                    continue
                saved = self._saved_shape(item)
                tensor = narrow_tensor_by_index(
                    record_tensor(data, self._dtypes[item.storage_index.fqn], saved),
                    item.storage_offsets, item.lengths)
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

    def _saved_shape(self, item: ReadItem) -> tuple[int, ...]:
        """The shape of the saved chunk that ``item`` reads (from the metadata)."""
        md = self.fetcher.ckpt.metadata().state_dict_metadata[item.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        want = tuple(item.storage_index.offset or ())
        for c in md.chunks:
            if tuple(c.offsets) == want:
                return tuple(c.sizes)
        return tuple(md.size)

    @property
    def checkpoint_id(self) -> str:
        return self.fetcher.ckpt.location

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def tensor_plan(md: Metadata, fqns: Sequence[str]) -> list[tuple[StorageInfo, str]]:
    """Every saved chunk of ``fqns``, in that order (what :func:`assemble` will take)."""
    out = []
    for fqn in fqns:
        entry = md.state_dict_metadata[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        out += [(md.storage_data[MetadataIndex(fqn, tuple(c.offsets))], fqn)
                for c in entry.chunks]
    return out


def assemble(spans: SpanReader, md: Metadata, fqn: str) -> torch.Tensor:
    """The whole tensor ``fqn`` from all of its saved chunks (any world size): one tensor
    in memory, plus the spans read ahead. A tensor saved in one chunk is returned as a
    read-only view of the bytes read (no copy); treat the result as read-only."""
    entry = md.state_dict_metadata.get(fqn)
    if not isinstance(entry, TensorStorageMetadata):
        raise ConfigError(f"{fqn!r} is not a tensor of {spans.fetcher.ckpt.location}")
    dtype = entry.properties.dtype
    if len(entry.chunks) == 1 and tuple(entry.chunks[0].sizes) == tuple(entry.size):
        info = md.storage_data[MetadataIndex(fqn, tuple(entry.chunks[0].offsets))]
        return record_tensor(spans.get(info), dtype, tuple(entry.size))  # no copy
    out = torch.empty(tuple(entry.size), dtype=dtype)
    for chunk in entry.chunks:
        info = md.storage_data[MetadataIndex(fqn, tuple(chunk.offsets))]
        part = record_tensor(spans.get(info), dtype, tuple(chunk.sizes))
        view = out
        for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            view = view.narrow(dim, o, n)
        if view.shape != part.shape:
            raise CorruptDataError(f"{fqn}: chunk at {tuple(chunk.offsets)} holds "
                                   f"{tuple(part.shape)}, expected {tuple(view.shape)}")
        view.copy_(part)
    return out
