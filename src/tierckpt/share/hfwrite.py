"""Write Hugging Face-style sharded checkpoints one tensor at a time, in bounded memory.

The writer knows nothing about where tensors come from: the caller gives the list of
:class:`TensorSpec` (names, shapes, dtypes — known before any tensor is read) and a
``read(spec)`` callable. The order of work, for :func:`write_hf`:

1. **plan** (pure, nothing read; :mod:`~tierckpt.share.hfplan`): ``output_dtype`` fixes
   each tensor's output dtype, ``plan_shards`` groups the specs into shards, the file names
   follow from the count;
2. **write** (:mod:`~tierckpt.share.hfshards`), into a temporary sibling
   ``.{out_dir.name}.tmp-<random>`` of ``out_dir``, shard by shard. Safetensors: the
   shard's header is written first (it depends only on the plan), then ``read`` is called
   for one tensor at a time, which is cast, written and dropped before the next ``read`` —
   at most one source tensor plus its cast copy is in RAM, never a shard. Torch format: one
   shard's tensors are held, then ``torch.save``'d. SHA-256 digests are computed on the
   same pass (no re-read);
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
import json
import os
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.share.hfplan import (
    FORMATS,
    SAFETENSORS_CODES,
    SHA256SUMS,
    Format,
    TensorSpec,
    index_name,
    output_dtype,
    plan_shards,
    shard_names,
    tensor_bytes,
)
from tierckpt.share.hfshards import Tally, WrittenFile, create_file, write_safetensors, write_torch
from tierckpt.tier1 import fs


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
    if format not in FORMATS:
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
    taken = {*names, index_name(format), SHA256SUMS}
    for name, data in (extra_files or {}).items():
        if (not isinstance(name, str) or not name or name.startswith(".") or name in taken
                or any(c in name for c in "/\\\n\r")):
            raise ConfigError(f"extra file name {name!r} must be a plain file name, not "
                              f"hidden and not one of the files written here")
        if not isinstance(data, bytes):
            raise ConfigError(f"extra file {name}: contents must be bytes")
    return header_meta


# --- writing ---------------------------------------------------------------------------------


def _write_all(tmp: Path, shards: list[list[TensorSpec]], names: list[str],
               read: Callable[[TensorSpec], torch.Tensor], format: Format,
               dtype: torch.dtype | None, header_meta: dict[str, str],
               progress: Callable[[int, int], None] | None,
               extra_files: dict[str, bytes]) -> ExportResult:
    total = sum(tensor_bytes(s, dtype) for shard in shards for s in shard)
    tally = Tally(total, progress)
    files: list[WrittenFile] = []
    for shard, name in zip(shards, names, strict=True):
        with create_file(tmp / name, files) as w:
            if format == "safetensors":
                write_safetensors(w, shard, read, dtype, header_meta, tally)
            else:
                write_torch(w, shard, read, dtype, tally)
    if len(shards) > 1:  # save_pretrained writes an index only when sharded
        weight_map = {s.name: name
                      for shard, name in zip(shards, names, strict=True) for s in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        extra_files = {index_name(format): _json_file(index), **extra_files}
    for name, data in extra_files.items():
        with create_file(tmp / name, files) as w:
            w.write(data)
    sums = "".join(f"{f.sha256}  {f.name}\n" for f in files).encode()
    with create_file(tmp / SHA256SUMS, files) as w:
        w.write(sums)
    return ExportResult(tuple(files), sum(map(len, shards)), total, tally.peak)


def _json_file(obj: object) -> bytes:
    """JSON as ``save_pretrained`` writes its index: indented, sorted keys, final newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()

