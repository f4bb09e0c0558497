"""One shard file of a Hugging Face-style export, written tensor by tensor and hashed on the
same pass (no re-read).

:func:`write_safetensors` writes the shard's header first (it depends only on the plan),
then calls ``read`` for one tensor at a time, which is checked, cast, written and dropped
before the next ``read``: at most one source tensor plus its cast copy is in RAM, never a
shard. :func:`write_torch` holds one shard's tensors, then ``torch.save``s them (the bound
there is the shard). Every file goes through :func:`create_file`: created exclusively,
fsync'd, and recorded as a :class:`WrittenFile` (name, size, SHA-256). ``read`` must
return a dense CPU tensor of exactly the spec's shape and dtype (ValueError naming the
tensor otherwise).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, cast

import torch

from tierckpt.errors import ConfigError
from tierckpt.share.hfplan import SAFETENSORS_CODES, TensorSpec, output_dtype, tensor_bytes
from tierckpt.tier1 import fs

# The reference loader refuses larger headers (safetensors' MAX_HEADER_SIZE).
_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class WrittenFile:
    """One file of the export: its name inside ``out_dir``, size in bytes, hex SHA-256."""

    name: str
    size: int
    sha256: str


class _HashingWriter:
    """A write-only file that hashes and counts what passes through (one pass, no re-read)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += len(view)
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()


@contextlib.contextmanager
def create_file(path: Path, files: list[WrittenFile]) -> Iterator[_HashingWriter]:
    """Create ``path`` exclusively, yield a hashing writer, fsync, record it in ``files``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                 fs.DEFAULT_FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        w = _HashingWriter(f)
        yield w
        f.flush()
        os.fsync(f.fileno())
    files.append(WrittenFile(path.name, w.size, w.sha.hexdigest()))


@dataclass
class Tally:
    """Running totals while writing: progress and the RAM high-water mark."""

    total: int
    progress: Callable[[int, int], None] | None
    done: int = 0
    peak: int = 0

    def tensor_done(self, nbytes: int, held: int) -> None:
        self.done += nbytes
        self.peak = max(self.peak, held)
        if self.progress is not None:
            self.progress(self.done, self.total)


def _safetensors_layout(shard: list[TensorSpec], dtype: torch.dtype | None) -> list[TensorSpec]:
    """Data order inside one safetensors shard: widest item size first, else given order.
    The data section starts 8-aligned and each size is a multiple of its item size, so
    every tensor starts aligned to its item size (the reference sorts the same way)."""
    return sorted(shard, key=lambda s: -output_dtype(s.dtype, dtype).itemsize)


def safetensors_header(shard: Sequence[TensorSpec], dtype: torch.dtype | None,
                       metadata: Mapping[str, str] | None) -> bytes:
    """The first bytes of a safetensors file for ``shard`` in this data order: 8-byte
    little-endian header length, then compact JSON (``__metadata__`` first, then one
    entry per tensor with ``dtype`` code, ``shape`` and ``data_offsets`` relative to the
    data section) padded with spaces to a multiple of 8, as the reference writer does."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in shard:
        code = SAFETENSORS_CODES[output_dtype(spec.dtype, dtype)]
        end = offset + tensor_bytes(spec, dtype)
        header[spec.name] = {"dtype": code, "shape": list(spec.shape),
                             "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    if len(raw) > _MAX_HEADER_BYTES:
        raise ConfigError(f"a safetensors header of {len(raw)} bytes exceeds the readers' "
                          f"limit of {_MAX_HEADER_BYTES}; lower max_shard_bytes")
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(w: _HashingWriter, shard: list[TensorSpec],
                       read: Callable[[TensorSpec], torch.Tensor], dtype: torch.dtype | None,
                       header_meta: dict[str, str], tally: Tally) -> None:
    order = _safetensors_layout(shard, dtype)
    w.write(safetensors_header(order, dtype, header_meta))
    for spec in order:
        nbytes, held = _stream_one(w, spec, read, dtype)
        tally.tensor_done(nbytes, held)


def _stream_one(w: _HashingWriter, spec: TensorSpec,
                read: Callable[[TensorSpec], torch.Tensor],
                dtype: torch.dtype | None) -> tuple[int, int]:
    """Read, cast and write one tensor; returns (bytes written, bytes held). Its own
    function so that every reference to the tensor dies on return, before the next read."""
    src = _read_checked(read, spec)
    out = _cast(src, output_dtype(spec.dtype, dtype))
    held = src.nbytes + (out.nbytes if out.data_ptr() != src.data_ptr() else 0)
    if out.numel():
        w.write(out.reshape(-1).view(torch.uint8).numpy().data)
    return out.nbytes, held


def write_torch(w: _HashingWriter, shard: list[TensorSpec],
                 read: Callable[[TensorSpec], torch.Tensor], dtype: torch.dtype | None,
                 tally: Tally) -> None:
    """One ``torch.save`` of the shard's dict: the whole shard is held (the bound here)."""
    tensors: dict[str, torch.Tensor] = {}
    held = 0
    for spec in shard:
        src = _read_checked(read, spec)
        out = _cast(src, output_dtype(spec.dtype, dtype))
        if out.untyped_storage().nbytes() != out.nbytes:  # torch.save writes whole storages
            out = out.clone()
        peak = held + src.nbytes + (out.nbytes if out.data_ptr() != src.data_ptr() else 0)
        del src
        tensors[spec.name] = out
        held += out.nbytes
        tally.tensor_done(out.nbytes, peak)
    torch.save(tensors, cast("IO[bytes]", w))  # it only calls write() and flush()


def _read_checked(read: Callable[[TensorSpec], torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    t = read(spec)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"read({spec.name!r}) returned {type(t).__name__}, not a tensor")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise ValueError(f"read({spec.name!r}) returned a {t.layout} tensor on {t.device}; "
                         "a dense CPU tensor is required")
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ValueError(f"read({spec.name!r}) returned {t.dtype}{list(t.shape)}, expected "
                         f"{spec.dtype}{list(spec.shape)}")
    return t


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous, plain (no grad, no conj/neg bit) tensor of ``dtype``; ``t``
    itself when it already is one."""
    return t.detach().to(dtype).resolve_conj().resolve_neg().contiguous()
