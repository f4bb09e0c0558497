"""A DCP ``StorageReader`` that reads tensors straight into their destination.

DCP's ``FileSystemReader`` ``torch.load``s every item into a fresh tensor and then copies
it into the target: two passes over memory and a transient extra copy of each tensor. For
files tierckpt wrote (each item a ``torch.save`` of a contiguous tensor that owns its
storage), the raw bytes sit uncompressed in the item's zip record, so this reader locates
them (zip central directory + local header, a few hundred bytes) and ``readinto``\\s the
destination's own memory. Anything else — narrowed reads, non-contiguous or non-CPU
destinations, dtype or size mismatches, byte items — takes DCP's path unchanged. Items are
read in file order, so each file is read sequentially once. ``.metadata`` is unpickled with
:func:`~tierckpt.restore.metadata.load_metadata` (an allowlist), never ``pickle.load``.

Given the manifest's entries (``verify=``), each file's CRC32C is checked from the bytes
that pass through anyway (the destinations, just filled, plus the few header bytes between
them); a mismatch raises :class:`~tierckpt.errors.IntegrityError` before the load returns.
A file this rank reads only a small part of (a reshard, or replicated items in another
rank's file) is checked record by record instead, against its per-record CRC32Cs (inline
``chunks`` in older manifests, else the writer's ``__<rank>.records`` through ``chunks=``, a
:class:`~tierckpt.format.records.ChunkIndex`): each record read, plus its few header bytes;
a file without them is left to the other checks (reading all of it would be a second pass).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from tierckpt._runs import contiguous_runs
from tierckpt._torch.dcp import StorageInfo, narrow_tensor_by_index
from tierckpt.errors import IntegrityError
from tierckpt.format import checksum, layout
from tierckpt.format.manifest import Chunk, FileEntry, Manifest
from tierckpt.format.records import ChunkIndex
from tierckpt.format.torchzip import tensor_data_offset
from tierckpt.restore.metadata import read_metadata_file
from tierckpt.tier1.catalog import MANIFEST_LIMIT, read_small

_PIECE = 16 * 1024 * 1024
READ_STREAMS = 4  # sequential read streams of a rank alone on its tier-1 disk
RAM_STREAMS = 2   # reads from tier 0 (tmpfs): each a memcpy, so about one per core
RAM_PIECE = 1024 * 1024
"""A read from RAM is checksummed while it is still in the core's L2 cache (a 16 MiB piece
is not): the checksum then costs compute, not a second trip through memory."""
_GAP_FRACTION = 0.05  # verify a file when what this rank skipped of it is at most 5 %
_GAP_MIN = 1 << 20    # ... or at most 1 MiB


def _raw_data_offset(fd: int, info: StorageInfo, nbytes: int) -> int | None:
    """Absolute file offset of the ``nbytes`` raw tensor bytes in the ``torch.save`` record
    ``info`` points at, or None when it is not a plain one-storage record of that size."""
    def read(offset: int, n: int) -> bytes:
        return os.pread(fd, n, info.offset + offset)

    off = tensor_data_offset(read, info.length, nbytes)
    return None if off is None else info.offset + off


def directory_chunks(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> ChunkIndex:
    """The per-record CRC32Cs of the checkpoint directory ``ckpt_dir`` (its verified
    ``manifest``), its records files read on demand (bounded like a manifest)."""
    root = Path(ckpt_dir)
    return ChunkIndex(manifest, lambda name: read_small(root / name, MANIFEST_LIMIT),
                      location=str(root))


class DirectReader(FileSystemReader):
    """FileSystemReader that loads tierckpt-written tensors in place and counts bytes read.

    The fast path relies on how tierckpt writes (every tensor a contiguous staging buffer
    that owns its storage), which a record's size alone cannot prove for foreign files (a
    transposed tensor has the same storage size), so by default (``direct=None``) it is on
    only for directories with a tierckpt ``manifest.json``. ``direct=False`` forces plain
    DCP behaviour."""

    def __init__(self, path: str | os.PathLike[str], *, direct: bool | None = None,
                 verify: Mapping[str, FileEntry] | None = None,
                 threads: int = READ_STREAMS, chunks: ChunkIndex | None = None,
                 piece: int = _PIECE) -> None:
        super().__init__(path)
        self.piece = piece
        """Bytes per read (and per CRC32C update) of a tensor read in place."""
        self.chunk_index = chunks
        """Where per-record CRC32Cs not inline in ``verify``'s entries come from (the
        writers' ``__<rank>.records``, read only when a file is read in part)."""
        self._chunk_maps: dict[str, dict[tuple[int, int], Chunk]] = {}
        self.threads = max(1, threads)
        if direct is None:
            direct = (Path(path) / layout.MANIFEST).is_file()
        self.direct = direct and sys.byteorder == "little"
        self.verify = verify
        self.bytes_read = 0
        self.direct_items = 0
        self.verified_files: list[str] = []
        """Files checked whole, from the bytes read (plus small gaps)."""
        self.verified_records = 0
        """Records checked one by one (files read in part; reshards)."""
        self.unverified_files: list[str] = []
        self._md_props: dict[str, torch.dtype] = {}
        self._metadata: dict[Any, Metadata] = {}
        self.metadata_rank: int | None = None
        """Whose metadata ``read_metadata()`` without ``rank=`` returns: None, the global
        ``.metadata``; a rank, that rank's own ``__<rank>.metadata`` (a restore on the saved
        layout sets it, so DCP's load plans from it)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``read_metadata`` (``rank=`` picks a rank-local file, as there), but the
        pickle may name only DCP's metadata classes: anything else raises
        :class:`~tierckpt.errors.UnsafeCheckpointError` before it runs. With ``verify``
        entries, a file the manifest lists must match its size and CRC32C before it is
        unpickled (:class:`~tierckpt.errors.IntegrityError`)."""
        rank = kwargs.get("rank", self.metadata_rank)
        if rank not in self._metadata:  # parsed once: the restore and DCP's load both ask
            path = self._get_metadata_path(rank)
            entry = self.verify.get(Path(path).name) if self.verify is not None else None
            self._metadata[rank] = read_metadata_file(path, load_id=self.load_id,
                                                      expect=entry)
        return self._metadata[rank]

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._md_props = {fqn: md.properties.dtype
                          for fqn, md in metadata.state_dict_metadata.items()
                          if isinstance(md, TensorStorageMetadata)}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        for rel, items in per_file.items():
            items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
            with open(Path(self.path) / rel, "rb") as f:
                with contextlib.suppress(OSError, AttributeError):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self.bytes_read += sum(self.storage_data[i.storage_index].length
                                       for i in items)
                wanted = self._in_place_candidates(items, planner) if self.direct else []
                candidates = {id(item) for item, _ in wanted}
                seen: list[tuple[int, int, int]] = []  # (offset, length, CRC32C) read
                for item in items:
                    if id(item) not in candidates:
                        seen.append(self._read_dcp(f, rel, item, planner))
                located, pieces = self._read_in_place(f, wanted)
                seen += pieces
                jobs: list[tuple[ReadItem, torch.Tensor, int]] = []
                for item, target in wanted:
                    if id(item) in located:
                        jobs.append((item, target, located[id(item)]))
                    else:  # not a plain one-storage record: DCP's path
                        seen.append(self._read_dcp(f, rel, item, planner))
                if self.verify is not None and not self._check_crc(f, rel, seen):
                    self._check_records(f, rel, [
                        (self.storage_data[i.storage_index], off, _bytes_of(t))
                        for i, t, off in jobs])
                for item, target, _ in jobs:
                    planner.commit_tensor(item, target)
                    self.direct_items += 1
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _in_place_candidates(self, items: list[ReadItem], planner: LoadPlanner
                             ) -> list[tuple[ReadItem, torch.Tensor]]:
        """The items of one file (in file order) whose destination can take the record's raw
        bytes: whole tensors, contiguous CPU destinations of the saved dtype and shape. The
        others take DCP's path."""
        wanted: list[tuple[ReadItem, torch.Tensor]] = []
        for item in items:
            info = self.storage_data[item.storage_index]
            if item.type != LoadItemType.TENSOR or info.transform_descriptors:
                continue
            if any(o != 0 for o in item.storage_offsets):
                continue
            target = planner.resolve_tensor(item).detach()
            if (target.device.type != "cpu" or not target.is_contiguous()
                    or tuple(target.shape) != tuple(item.lengths)
                    or self._md_props.get(item.storage_index.fqn) != target.dtype
                    or target.numel() == 0):
                continue
            wanted.append((item, target))
        return wanted

    def _read_in_place(self, f: BinaryIO, wanted: list[tuple[ReadItem, torch.Tensor]]
                       ) -> tuple[dict[int, int], list[tuple[int, int, int]]]:
        """Read each candidate's raw bytes into its destination, in pieces of
        :attr:`piece` bytes (16 MiB from disk, 1 MiB from RAM).

        The pieces, in file order, are cut into ``threads`` contiguous runs of about equal
        bytes, one per thread, each read front to back: every thread is one sequential
        stream that the kernel's readahead follows (interleaving small pieces across
        threads defeated it: 0.55× the single-stream rate on a virtual disk), and a device
        that serves parallel streams faster gets several. A thread locates a record's raw
        bytes (two small reads of its zip header) just before reading them: the header sits
        right after the previous record's bytes, inside the readahead window, so only a
        run's first record costs a seek (locating every record up front cost two cold
        random reads per record: 15–65 ms per GiB on one stream). preadv and crc32c release
        the GIL; each piece's CRC32C is taken on its thread while its bytes are hot in cache.

        Returns the located records (``id(item)`` → file offset of the raw bytes; a record
        that is not a plain one-storage ``torch.save`` of that size is absent and was not
        touched) and ``(file offset, length, CRC32C)`` per piece read, in file order."""
        pieces: list[tuple[int, memoryview, int]] = []  # (candidate, bytes, start in them)
        for j, (_, target) in enumerate(wanted):
            buf = _bytes_of(target)
            step = self.piece
            pieces.extend((j, buf[i:i + step], i) for i in range(0, len(buf), step))
        if not pieces:
            return {}, []
        fd, crc = f.fileno(), self.verify is not None

        def run(part: list[tuple[int, memoryview, int]]
                ) -> tuple[dict[int, int | None], list[tuple[int, int, int]]]:
            where: dict[int, int | None] = {}
            out: list[tuple[int, int, int]] = []
            for j, buf, start in part:
                if j not in where:
                    item, target = wanted[j]
                    where[j] = _raw_data_offset(fd, self.storage_data[item.storage_index],
                                                target.numel() * target.element_size())
                base = where[j]
                if base is None:
                    continue
                off, done = base + start, 0
                while done < len(buf):
                    n = os.preadv(fd, [buf[done:]], off + done)
                    if n <= 0:
                        raise IntegrityError(f"short read of {f.name} at {off + done}")
                    done += n
                if out and out[-1][0] + out[-1][1] == off:  # one stretch: one CRC to combine
                    o, n, c = out[-1]
                    out[-1] = (o, n + len(buf), checksum.extend(c, buf) if crc else 0)
                else:
                    out.append((off, len(buf), checksum.extend(0, buf) if crc else 0))
            return where, out

        runs = contiguous_runs(pieces, self.threads, lambda p: len(p[1]))
        with ThreadPoolExecutor(len(runs), thread_name_prefix="tierckpt-read") as pool:
            results = list(pool.map(run, runs))
        located = {id(wanted[j][0]): off for where, _ in results
                   for j, off in where.items() if off is not None}
        return located, [c for _, out in results for c in out]

    def _check_crc(self, f: BinaryIO, rel: str, seen: list[tuple[int, int, int]]) -> bool:
        """CRC32C of file ``rel`` from the ranges that were read (``(offset, length, their
        CRC32C)``), combined in file order with the gaps between them (read now) — when the
        gaps are small. Returns False when the file was not checked whole (no entry,
        overlapping reads, large gaps)."""
        entry = self.verify.get(rel) if self.verify is not None else None
        if entry is None:
            self.unverified_files.append(rel)
            return True
        seen.sort()
        pos = gaps = 0
        for off, n, _ in seen:
            if off < pos:  # overlapping reads: not a tiling we can hash in order
                return False
            gaps, pos = gaps + off - pos, off + n
        gaps += max(0, entry.size - pos)
        if gaps > max(_GAP_MIN, _GAP_FRACTION * entry.size):
            return False
        crc = pos = 0
        fd = f.fileno()
        for off, n, part in [*seen, (entry.size, 0, 0)]:
            if off > pos:
                crc = checksum.extend(crc, os.pread(fd, off - pos, pos))
            crc, pos = checksum.combine(crc, part, n) if n else crc, off + n
        if crc != entry.crc32c or pos != entry.size:
            raise IntegrityError(f"{rel} CRC32C {checksum.to_hex(crc)} != manifest "
                                 f"{checksum.to_hex(entry.crc32c)} (found while reading)")
        self.verified_files.append(rel)
        return True

    def _chunks(self, rel: str) -> dict[tuple[int, int], Chunk]:
        """File ``rel``'s per-record CRC32Cs by ``(offset, length)``: inline in its entry,
        else from its writer's records file (checked against the manifest when loaded)."""
        if rel not in self._chunk_maps:
            entry = self.verify.get(rel) if self.verify is not None else None
            chunks = () if entry is None else entry.chunks or (
                self.chunk_index.chunks(rel) if self.chunk_index is not None else ())
            self._chunk_maps[rel] = {(c.offset, c.length): c for c in chunks}
        return self._chunk_maps[rel]

    def _record_chunk(self, rel: str, info: StorageInfo) -> Chunk | None:
        return self._chunks(rel).get((info.offset, info.length))

    def _check_records(self, f: BinaryIO, rel: str,
                       records: list[tuple[StorageInfo, int, memoryview]]) -> None:
        """Check each in-place record of a file read in part against its own CRC32C: the
        header bytes before the tensor's, the tensor's (already in the destination), the
        trailer after. Without per-record CRC32Cs the file stays unverified."""
        if not self._chunks(rel):
            self.unverified_files.append(rel)
            return
        fd = f.fileno()
        for info, raw, buf in records:
            chunk = self._record_chunk(rel, info)
            if chunk is None:
                raise IntegrityError(f"{rel}: the manifest lists no record at "
                                     f"{info.offset}+{info.length} (.metadata and manifest "
                                     "disagree)")
            end = info.offset + info.length
            crc = checksum.extend(0, os.pread(fd, raw - info.offset, info.offset))
            crc = checksum.extend(crc, buf)
            crc = checksum.extend(crc, os.pread(fd, end - raw - len(buf), raw + len(buf)))
            if crc != chunk.crc32c:
                raise IntegrityError(f"{rel}: record {info.offset}+{info.length} CRC32C "
                                     f"{checksum.to_hex(crc)} != manifest "
                                     f"{checksum.to_hex(chunk.crc32c)} (found while reading)")
            self.verified_records += 1

    def _read_dcp(self, f: BinaryIO, rel: str, item: ReadItem, planner: LoadPlanner
                  ) -> tuple[int, int, int]:
        """DCP's own per-item path (``torch.load`` then copy into the target); returns
        ``(file offset, length, CRC32C)`` of the item's bytes as read. With a per-record
        CRC32C they are checked before use."""

        info = self.storage_data[item.storage_index]
        data = os.pread(f.fileno(), info.length, info.offset)
        if len(data) != info.length:
            raise IntegrityError(f"short read of {f.name}: {len(data)} of {info.length} bytes "
                                 f"at {info.offset}")
        crc = checksum.extend(0, data)
        chunk = self._record_chunk(rel, info)
        if chunk is not None:
            if crc != chunk.crc32c:
                raise IntegrityError(f"{rel}: record {info.offset}+{info.length} "
                                     f"({item.storage_index.fqn}) does not match its CRC32C "
                                     "in the manifest (found while reading)")
            self.verified_records += 1
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data))
            return info.offset, len(data), crc
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{item.storage_index} size {tuple(tensor.size())} != target "
                             f"{tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
        return info.offset, len(data), crc


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")
