"""A DCP ``StorageWriter`` that writes each rank's shard files into a checkpoint's tmp
directory, computing CRC32C on the same pass, fsyncing every file, and remembering what it
wrote (name, size, CRC32C) for the manifest.

Files are byte-for-byte what DCP's ``FileSystemWriter`` produces (``torch.save``'d items in
``__{rank}_{i}.distcp``, a pickled ``.metadata``), so ``FileSystemReader`` and plain
``dcp.load`` read a committed checkpoint. Each rank also writes its own items' metadata as
DCP's rank-local ``__{rank}.metadata`` (:meth:`ShardWriter.write_rank_metadata`). Each
item's record also gets its own CRC32C (a manifest :class:`~tierckpt.format.manifest.Chunk`,
from the same pass, kept in the rank's ``__{rank}.records``: :meth:`write_rank_records`), so
a reader that fetches one tensor's byte range can verify just that range.

Frozen tensors (``frozen``: a :class:`FrozenPlan`, for ``Writes(incremental=True)``) go
to a file of their own, ``__{rank}_{threads}.distcp``. When every one of them is unchanged
since the previous save and that save's frozen file held exactly these items, the file is
hard-linked from the previous step's directory instead of written (its size checked), and
its entry and write results are the previous ones: the same bytes at the same offsets, so
the step's ``.metadata`` and manifest read as if it had been written.

DCP's call order (per its ``StorageWriter`` docstring): ``reset`` →
``set_up_storage_writer`` → ``prepare_local_plan`` (every rank) → ``prepare_global_plan``
(coordinator) → ``write_data`` (every rank) → ``finish`` (coordinator, with every rank's
results).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt._torch.dcp import StorageInfo, StoragePrefix
from tierckpt.format import checksum, layout, records
from tierckpt.format.manifest import Chunk, FileEntry
from tierckpt.tier0 import recycle
from tierckpt.tier0.pages import KeptMappings
from tierckpt.tier1.directio import DirectFile
from tierckpt.tier1.fs import DEFAULT_FILE_MODE

_WRITE_BLOCK = 16 * 1024 * 1024
_CURRENT_DCP_VERSION = "1.0.0"


class _CrcFile(io.RawIOBase):
    """Write-only file that updates a CRC32C and a byte count with every write."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None  # the first write error (torch.save hides it)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        self.crc = checksum.extend(self.crc, mv)
        n, total = 0, len(mv)
        while n < total:
            try:
                n += os.write(self._fd, mv[n: n + _WRITE_BLOCK])
            except OSError as e:
                self.error = self.error or e
                raise
        self.size += total
        return total

    def tell(self) -> int:
        return self.size

    def seekable(self) -> bool:
        return False


_crc_lock = threading.Lock()
_crc_users = 0


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """Turn off torch.save's own per-record zip CRC32 while shard files are written.

    Every file already gets a CRC32C on the same pass (the one the manifest records and
    restore verifies), so the zip CRC32 is redundant work — about a third of the write
    time here. ``torch.load`` (and so DCP's reader) loads records without it. The switch is
    process-global in torch, so it is reference-counted across writer threads and restored
    when the last one finishes; a user ``torch.save`` in that window only loses the
    redundant zip CRC32, never data.
    """
    global _crc_users
    with _crc_lock:
        if _crc_users == 0:
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(True)


def _tensor_item_bytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * item.tensor_data.properties.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class FrozenFile:
    """A rank's file of frozen tensors as a save left it: the directory holding it (the
    committed step's), its manifest entry (with its records' CRC32Cs), its write results
    and its items."""

    directory: Path
    entry: FileEntry
    results: tuple[WriteResult, ...]
    items: frozenset[MetadataIndex]


@dataclasses.dataclass(frozen=True)
class FrozenPlan:
    """How this save treats frozen tensors: their DCP keys, whether none changed since the
    previous save (every one kept by the stager), and the previous save's frozen file to
    link when none did (None: write it)."""

    keys: frozenset[str]
    unchanged: bool
    previous: FrozenFile | None = None


class ShardWriter(StorageWriter):
    """Writes into ``path`` (which must be this save's fresh tmp directory).

    ``thread_count`` files per rank are written in parallel (items balanced by size).
    After ``write_data``, :attr:`files` lists this rank's files; after ``finish`` on the
    coordinator, :attr:`metadata_entry`/:attr:`metadata_bytes` describe ``.metadata``.
    With ``recycle`` (tier 0's ``free/`` directory), a shard file found there under its
    name is rewritten in place instead of created (:func:`tierckpt.tier0.recycle.take`);
    ``io_threads`` copies per file run at once (:class:`DirectFile`); ``mapped`` (this
    rank's :class:`~tierckpt.tier0.pages.KeptMappings`): a mapped recycled file is copied
    into (:attr:`mapped_bytes`). ``frozen``: see the module docstring; after
    ``write_data``, :attr:`frozen_file` is this save's frozen file (written or linked; its
    ``directory`` is ``path``) and :attr:`linked` its bytes when it was linked."""

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1,
                 file_mode: int = DEFAULT_FILE_MODE, fsync: bool = True,
                 direct_io: bool = True, recycle: Path | None = None,
                 io_threads: int = 1, frozen: FrozenPlan | None = None,
                 mapped: KeptMappings | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.thread_count = max(1, thread_count)
        self.file_mode = file_mode
        self.fsync = fsync
        self.direct_io = direct_io
        self.recycle = recycle
        self.io_threads = io_threads
        self.recycled = 0  # shard files rewritten in place (taken from ``recycle``)
        self.mapped, self.mapped_bytes = mapped, 0  # bytes copied into kept mappings
        self.rank = 0
        self.files: list[FileEntry] = []
        self.metadata_entry: FileEntry | None = None
        self.metadata_bytes: bytes | None = None
        self.zero_copied = 0
        """Bytes written straight from the staged tensors (no copy into I/O buffers)."""
        self.frozen = frozen
        self.frozen_file: FrozenFile | None = None
        self.linked = 0
        self._lock = threading.Lock()

    # -- StorageWriter protocol -----------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.files, self.metadata_entry, self.metadata_bytes = [], None, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=StoragePrefix(f"__{i}_"))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: StoragePrefix = plan.storage_data
        keys = self.frozen.keys if self.frozen is not None else frozenset()
        frozen = [i for i in plan.items
                  if i.type != WriteItemType.BYTE_IO and i.index.fqn in keys]
        taken = {id(i) for i in frozen}
        rest = [i for i in plan.items if id(i) not in taken]
        buckets = _balance(rest, self.thread_count)
        jobs = [(f"{prefix.prefix}{i}.distcp", items) for i, items in enumerate(buckets) if items]
        results: list[WriteResult] = []
        with _without_zip_crc32():
            if len(jobs) <= 1:
                for name, items in jobs:
                    results += self._write_file(name, items, planner)
            else:
                with ThreadPoolExecutor(len(jobs), thread_name_prefix="tierckpt-write") as pool:
                    for r in pool.map(lambda j: self._write_file(j[0], j[1], planner), jobs):
                        results += r
            if frozen:
                results += self._frozen(f"{prefix.prefix}{self.thread_count}.distcp", frozen,
                                        planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = _CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata)
        size, crc = self._write_small(layout.METADATA, data)
        self.metadata_bytes = data
        self.metadata_entry = FileEntry(name=layout.METADATA, size=size, crc32c=crc, rank=None)

    def finish_bytes(self, data: bytes) -> None:
        """:meth:`finish` with ``.metadata``'s bytes already built (a previous save's, when
        nothing it describes changed)."""
        size, crc = self._write_small(layout.METADATA, data)
        self.metadata_bytes = data
        self.metadata_entry = FileEntry(name=layout.METADATA, size=size, crc32c=crc, rank=None)

    def write_rank_metadata(self, metadata: Metadata) -> FileEntry:
        """Write this rank's own DCP metadata (``__<rank>.metadata``: ``metadata`` describes
        only the items this rank wrote) and list it among :attr:`files` (read whole: no
        per-record CRC32Cs). A restore on the saved layout reads it instead of ``.metadata``."""
        metadata.version = _CURRENT_DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        name = layout.rank_metadata_filename(self.rank)
        size, crc = self._write_small(name, pickle.dumps(metadata))
        entry = FileEntry(name=name, size=size, crc32c=crc, rank=self.rank)
        with self._lock:
            self.files.append(entry)
        return entry

    def write_rank_records(self) -> FileEntry:
        """Move the per-record CRC32Cs of this rank's shard files out of :attr:`files` into
        its records file (``__<rank>.records``, :mod:`tierckpt.format.records`), listed
        among :attr:`files` itself: the manifest then lists each shard file with its size
        and whole-file CRC32C only, so it grows by a few entries per rank, not by records."""
        with self._lock:
            shards = [f for f in self.files if f.chunks and f.name.endswith(".distcp")]
            name = layout.rank_records_filename(self.rank)
            size, crc = self._write_small(name, records.to_bytes(self.rank, shards))
            entry = FileEntry(name=name, size=size, crc32c=crc, rank=self.rank)
            moved = {f.name for f in shards}
            self.files = [dataclasses.replace(f, chunks=()) if f.name in moved else f
                          for f in self.files] + [entry]
        return entry

    def _write_small(self, name: str, data: bytes) -> tuple[int, int]:
        """Write a new file ``name`` holding ``data`` (fsync'd); its size and CRC32C."""
        fd = os.open(self.path / name,
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.file_mode)
        try:
            f = _CrcFile(fd)
            f.write(data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return f.size, f.crc

    def storage_meta(self) -> StorageMeta | None:
        """No id: where a checkpoint is read from is its id (the tmp directory it was
        written into is gone by then), and the same layout then pickles to the same
        ``.metadata`` every save (``coordinate.PlanCache.metadata_bytes``)."""
        return StorageMeta()

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    # -- internals ------------------------------------------------------------------------
    def _frozen(self, name: str, items: list[WriteItem],
                planner: SavePlanner) -> list[WriteResult]:
        """The frozen tensors' file: linked from the previous step when none changed and it
        held exactly these items, else written."""
        assert self.frozen is not None
        held = frozenset(i.index for i in items)
        prev = self.frozen.previous
        if self.frozen.unchanged and prev is not None and prev.items == held \
                and prev.entry.name == name and self._link(prev):
            self.frozen_file = dataclasses.replace(prev, directory=self.path)
            return list(prev.results)
        out = self._write_file(name, items, planner)
        with self._lock:
            entry = next(f for f in self.files if f.name == name)
        self.frozen_file = FrozenFile(self.path, entry, tuple(out), held)
        return out

    def _link(self, prev: FrozenFile) -> bool:
        """Hard-link ``prev``'s file into this save (False when it is gone or not of its
        recorded size: then it is written)."""
        src, dst = prev.directory / prev.entry.name, self.path / prev.entry.name
        try:
            if src.stat().st_size != prev.entry.size:
                return False
            os.link(src, dst)
        except OSError:
            return False
        with self._lock:
            self.files.append(prev.entry)
            self.linked += prev.entry.size
        return True

    def _write_file(self, name: str, items: list[WriteItem],
                    planner: SavePlanner) -> list[WriteResult]:
        path = self.path / layout.safe_member_name(name)
        out: list[WriteResult] = []
        chunks: list[Chunk] = []
        reuse = self.recycle is not None and recycle.take(self.recycle, name, path)
        mapping = self.mapped.lookup(path) if reuse and self.mapped is not None else None
        # zero_copy: the items are staged tensors, unchanged until the save ends
        f = DirectFile(path, mode=self.file_mode, direct=self.direct_io, fsync=self.fsync,
                       zero_copy=True, reuse=reuse, io_threads=self.io_threads,
                       mapping=mapping)
        try:
            # bytes items first (as DCP does), then tensors largest first
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    f.write(data.getbuffer())
                else:
                    assert isinstance(data, torch.Tensor) and data.device.type == "cpu"
                    torch.save(data, f)  # type: ignore[arg-type]
                offset, length, crc = f.mark()  # after any alignment padding
                chunks.append(Chunk(offset, length, crc))
                out.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=StorageInfo(name, offset, length)))
            f.close()  # flush, truncate, fsync
        except Exception as e:
            f.abort()
            # free the space now (a full disk is the usual cause); the tmp dir goes at start-up
            with contextlib.suppress(OSError):
                os.unlink(path)
            # torch.save swallows the OSError raised by our write (e.g. ENOSPC, EDQUOT)
            # and fails later with an opaque zip error; report the real cause.
            if f.error is not None and f.error is not e:
                raise f.error from e
            raise
        with self._lock:
            self.zero_copied += f.zero_copied
            self.recycled += reuse
            self.mapped_bytes += f.mapped_bytes
            self.files.append(FileEntry(name=name, size=f.size, crc32c=f.crc, rank=self.rank,
                                        chunks=tuple(chunks)))
        return out


def _balance(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Split items into ``bins`` groups of similar byte size (bytes items spread evenly)."""
    if bins == 1:
        return [list(items)]
    out: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO),
                     key=_tensor_item_bytes, reverse=True)
    for k, it in enumerate(byte_items):
        out[k % bins].append(it)
    for it in tensors:
        j = sizes.index(min(sizes))
        out[j].append(it)
        sizes[j] += _tensor_item_bytes(it)
    return out
