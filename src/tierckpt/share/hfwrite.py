"""Write Hugging Face-style sharded checkpoints one tensor at a time, in bounded memory.

The writer knows nothing about where tensors come from: the caller gives the list of
:class:`TensorSpec` (names, shapes, dtypes — known before any tensor is read) and a
``read(spec)`` callable. The order of work, for :func:`write_hf`:

1. **plan** (pure, nothing read): :func:`output_dtype` fixes each tensor's output dtype,
   :func:`plan_shards` groups the specs into shards, the file names follow from the count;
2. **write**, into a temporary sibling ``.{out_dir.name}.tmp-<random>`` of ``out_dir``,
   shard by shard. Safetensors: the shard's header is written first (it depends only on the
   plan), then ``read`` is called for one tensor at a time, which is cast, written and
   dropped before the next ``read`` — at most one source tensor plus its cast copy is in
   RAM, never a shard. Torch format: one shard's tensors are held, then ``torch.save``'d.
   SHA-256 digests are computed on the same pass (no re-read);
3. the index (several shards only, as ``save_pretrained`` does), any ``extra_files`` and
   ``SHA256SUMS`` are written; every file was fsync'd, then the directory;
4. **commit**: the temporary directory is renamed to ``out_dir`` and its parent fsync'd.
   On any failure before that the temporary directory is removed: ``out_dir`` either
   appears complete or not at all.

Output layout (the names ``transformers`` 5 writes and looks for)::

    model.safetensors                     one shard
    model-00001-of-00003.safetensors …    several, plus model.safetensors.index.json =
                                          {"metadata": {"total_size": N}, "weight_map": {…}}
    pytorch_model.bin / pytorch_model-00001-of-00003.bin … + pytorch_model.bin.index.json
    SHA256SUMS                            ``sha256sum -c`` format, every other file
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Literal, cast

import torch

from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.tier1 import fs

Format = Literal["safetensors", "torch"]

SHA256SUMS = "SHA256SUMS"

_CODES_BY_NAME = (  # torch dtype name -> code; names a torch build lacks are skipped
    ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"), ("complex64", "C64"),
    ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"),
    ("uint64", "U64"), ("uint32", "U32"), ("uint16", "U16"), ("uint8", "U8"),
    ("bool", "BOOL"),
)

#: The dtype codes of the safetensors format (what the reference writer emits). Left out
#: on purpose: ``float4_e2m1fn_x2`` (stored with a doubled last dimension) and complex128
#: (no code).
SAFETENSORS_CODES: dict[torch.dtype, str] = {
    getattr(torch, name): code for name, code in _CODES_BY_NAME if hasattr(torch, name)
}

# The reference loader refuses larger headers (safetensors' MAX_HEADER_SIZE).
_MAX_HEADER_BYTES = 100_000_000

# (stem, extension, index file) per format: transformers' WEIGHTS_NAME / SAFE_WEIGHTS_NAME.
_NAMES: dict[str, tuple[str, str, str]] = {
    "safetensors": ("model", ".safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model", ".bin", "pytorch_model.bin.index.json"),
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write, known before any tensor is read: its output ``name`` (already
    mapped, e.g. ``model.layers.0.mlp.up_proj.weight``), ``shape`` and ``dtype`` as stored
    in the source (the cast, if any, is :func:`output_dtype`'s business)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.shape, tuple) or not all(
                type(d) is int and d >= 0 for d in self.shape):
            raise ConfigError(f"{self.name}: shape must be a tuple of non-negative ints, "
                              f"got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"{self.name}: dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor, 0 for an empty one)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class WrittenFile:
    """One file of the export: its name inside ``out_dir``, size in bytes, hex SHA-256."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ExportResult:
    """What :func:`write_hf` committed.

    ``files``: every file in write order — shards, index, extra files, ``SHA256SUMS`` last
    (the only one not listed inside ``SHA256SUMS``). ``tensor_bytes``: tensor data written,
    after casting (the index's ``total_size``). ``peak_tensor_bytes``: the most tensor data
    the writer held at once — the RAM bound: for safetensors the largest source tensor
    plus its cast copy; for torch format the largest shard plus the tensor being cast.
    """

    files: tuple[WrittenFile, ...]
    tensors: int
    tensor_bytes: int
    peak_tensor_bytes: int


def output_dtype(spec_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The cast rule: with ``dtype=None`` a tensor keeps ``spec_dtype``; otherwise
    floating-point tensors become ``dtype`` and integer, bool and complex tensors (step
    counters, masks) keep theirs. ``dtype`` must be a floating dtype safetensors can store
    (ConfigError otherwise, naming the accepted ones)."""
    if dtype is None:
        return spec_dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point \
            or dtype not in SAFETENSORS_CODES:
        accepted = ", ".join(str(d).removeprefix("torch.") for d in SAFETENSORS_CODES
                             if d.is_floating_point)
        raise ConfigError(f"cannot cast to {dtype}: the output dtype must be a floating "
                          f"dtype, one of {accepted} (integer and bool tensors always keep "
                          "their dtype)")
    return dtype if spec_dtype.is_floating_point else spec_dtype


def tensor_bytes(spec: TensorSpec, dtype: torch.dtype | None) -> int:
    """Bytes ``spec`` occupies once written: elements × the output dtype's item size."""
    return spec.numel * output_dtype(spec.dtype, dtype).itemsize


def plan_shards(specs: Sequence[TensorSpec], *, max_shard_bytes: int,
                dtype: torch.dtype | None) -> list[list[TensorSpec]]:
    """Group ``specs`` into shards before anything is read: greedily in the given order, a
    new shard starting when the next tensor would take the current one past
    ``max_shard_bytes``; a tensor larger than the limit gets a shard of its own (unlike
    ``save_pretrained``, which keeps filling the shard it interrupts, order is kept).
    Sizes are shape × output dtype size. ConfigError for an empty list, a duplicate name
    or a non-positive limit."""
    if type(max_shard_bytes) is not int or max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    _check_names(specs)
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        n = tensor_bytes(spec, dtype)
        if current and size + n > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += n
    shards.append(current)
    return shards


def shard_names(format: Format, count: int) -> list[str]:
    """File names of ``count`` shards, as ``save_pretrained`` names them."""
    stem, ext, _ = _NAMES[format]
    if count == 1:
        return [stem + ext]
    return [f"{stem}-{i:05d}-of-{count:05d}{ext}" for i in range(1, count + 1)]


def write_hf(out_dir: Path, specs: Sequence[TensorSpec],
             read: Callable[[TensorSpec], torch.Tensor], *,
             format: Format = "safetensors", max_shard_bytes: int = 5 * 10**9,
             dtype: torch.dtype | None = None, metadata: Mapping[str, str] | None = None,
             progress: Callable[[int, int], None] | None = None,
             extra_files: Mapping[str, bytes] | None = None) -> ExportResult:
    """Write ``specs`` as a Hugging Face-style checkpoint in ``out_dir`` (see the module
    docstring for the steps and the memory bound) and return what was committed.

    ``read(spec)`` is called once per tensor, shard by shard; within a safetensors shard
    the widest dtypes come first (else the given order), so that every tensor is aligned to
    its item size as with the reference writer. It must return a dense CPU tensor of exactly
    ``spec.shape`` and ``spec.dtype`` (ValueError naming the tensor otherwise) and should
    not keep a reference to it. ``metadata`` goes into each safetensors header's
    ``__metadata__``, over the ``{"format": "pt"}`` that ``save_pretrained`` writes.
    ``progress(done_bytes, total_bytes)`` is called after each tensor. ``extra_files``
    (e.g. ``{"config.json": …}``) are written verbatim, inside the same commit and in
    ``SHA256SUMS``. ``out_dir`` must not exist (ConfigError: the CLI's ``--force``
    removes it first) and its parent must; ``dtype`` follows :func:`output_dtype`.
    """
    out_dir = Path(out_dir)
    if format not in _NAMES:
        raise ConfigError(f"format must be 'safetensors' or 'torch', got {format!r}")
    shards = plan_shards(specs, max_shard_bytes=max_shard_bytes, dtype=dtype)
    names = shard_names(format, len(shards))
    header_meta = _check_inputs(out_dir, specs, format, dtype, metadata, extra_files, names)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(mode=fs.DEFAULT_DIR_MODE)
    try:
        result = _write_all(tmp, shards, names, read, format, dtype, header_meta, progress,
                            dict(extra_files or {}))
        fs.fsync_dir(tmp)
        # Checked again: rename(2) would silently replace an empty directory created
        # meanwhile (there is no portable no-replace rename); this narrows that window.
        if os.path.lexists(out_dir):
            raise ConfigError(_exists_message(out_dir))
        os.rename(tmp, out_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.remove_tree(tmp)
        raise
    fs.fsync_dir(out_dir.parent)
    return result


# --- checks (before anything is written) ---------------------------------------------------


def _check_names(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise ConfigError("nothing to write: the list of tensors is empty")
    counts = Counter(s.name for s in specs)
    dupes = sorted(name for name, n in counts.items() if n > 1)
    if dupes:
        raise ConfigError(f"duplicate tensor names (each must be written once): {dupes[:5]}")
    if "__metadata__" in counts:
        raise ConfigError("'__metadata__' is reserved by safetensors; rename that tensor")


def _exists_message(out_dir: Path) -> str:
    return (f"{out_dir} already exists; pass --force to replace it, or choose another "
            "directory")


def _check_inputs(out_dir: Path, specs: Sequence[TensorSpec], format: Format,
                  dtype: torch.dtype | None, metadata: Mapping[str, str] | None,
                  extra_files: Mapping[str, bytes] | None, names: list[str]) -> dict[str, str]:
    """Everything that can be refused before a byte is written; returns the safetensors
    ``__metadata__``."""
    if os.path.lexists(out_dir):
        raise ConfigError(_exists_message(out_dir))
    if not out_dir.parent.is_dir():
        raise ConfigError(f"{out_dir.parent} is not a directory; create it first")
    if format == "safetensors":
        if sys.byteorder != "little":
            raise CheckpointError("safetensors files are little-endian; this host is not")
        for spec in specs:
            out = output_dtype(spec.dtype, dtype)
            if out not in SAFETENSORS_CODES:
                raise ConfigError(f"{spec.name}: safetensors has no code for {out}; "
                                  "use format='torch' or cast it in the source")
    header_meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in header_meta.items()):
        raise ConfigError(f"metadata must map str to str, got {metadata!r}")
    taken = {*names, _NAMES[format][2], SHA256SUMS}
    for name, data in (extra_files or {}).items():
        if (not isinstance(name, str) or not name or name.startswith(".") or name in taken
                or any(c in name for c in "/\\\n\r")):
            raise ConfigError(f"extra file name {name!r} must be a plain file name, not "
                              f"hidden and not one of the files written here")
        if not isinstance(data, bytes):
            raise ConfigError(f"extra file {name}: contents must be bytes")
    return header_meta


# --- writing ---------------------------------------------------------------------------------


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
def _create(path: Path, files: list[WrittenFile]) -> Iterator[_HashingWriter]:
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
class _Tally:
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


def _write_all(tmp: Path, shards: list[list[TensorSpec]], names: list[str],
               read: Callable[[TensorSpec], torch.Tensor], format: Format,
               dtype: torch.dtype | None, header_meta: dict[str, str],
               progress: Callable[[int, int], None] | None,
               extra_files: dict[str, bytes]) -> ExportResult:
    total = sum(tensor_bytes(s, dtype) for shard in shards for s in shard)
    tally = _Tally(total, progress)
    files: list[WrittenFile] = []
    for shard, name in zip(shards, names, strict=True):
        with _create(tmp / name, files) as w:
            if format == "safetensors":
                _write_safetensors(w, shard, read, dtype, header_meta, tally)
            else:
                _write_torch(w, shard, read, dtype, tally)
    if len(shards) > 1:  # save_pretrained writes an index only when sharded
        weight_map = {s.name: name
                      for shard, name in zip(shards, names, strict=True) for s in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        extra_files = {_NAMES[format][2]: _json_file(index), **extra_files}
    for name, data in extra_files.items():
        with _create(tmp / name, files) as w:
            w.write(data)
    sums = "".join(f"{f.sha256}  {f.name}\n" for f in files).encode()
    with _create(tmp / SHA256SUMS, files) as w:
        w.write(sums)
    return ExportResult(tuple(files), sum(map(len, shards)), total, tally.peak)


def _json_file(obj: object) -> bytes:
    """JSON as ``save_pretrained`` writes its index: indented, sorted keys, final newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


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


def _write_safetensors(w: _HashingWriter, shard: list[TensorSpec],
                       read: Callable[[TensorSpec], torch.Tensor], dtype: torch.dtype | None,
                       header_meta: dict[str, str], tally: _Tally) -> None:
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


def _write_torch(w: _HashingWriter, shard: list[TensorSpec],
                 read: Callable[[TensorSpec], torch.Tensor], dtype: torch.dtype | None,
                 tally: _Tally) -> None:
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
