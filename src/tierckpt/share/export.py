"""Export part of a checkpoint (by default the model) as a consolidated, serving-ready copy:
Hugging Face-style sharded safetensors (or torch) files, streamed with bounded memory.

Each tensor is assembled from its saved chunks (any world size), verified record by record
(:mod:`tierckpt.share.ranged`), cast if asked, and written before the next is read: peak
RAM is about one tensor (and its cast copy; ``ExportResult.peak_tensor_bytes``) plus the
records read ahead, at most half a shard (``max_shard_bytes``, up to 128 MiB). Names are
the checkpoint's with the top-level key removed (``model.``), then
``strip_prefix`` removed and ``add_prefix`` put in front.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from tierckpt.errors import ConfigError
from tierckpt.share.hfplan import Format, TensorSpec
from tierckpt.share.hfwrite import ExportResult, write_hf
from tierckpt.share.loader import require_keys
from tierckpt.share.ranged import (
    WINDOW,
    RecordFetcher,
    SpanReader,
    VerifyMode,
    assemble,
    tensor_plan,
)
from tierckpt.share.source import Step, open_checkpoint
from tierckpt.tier1 import fs

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
          "float32": torch.float32, "float": torch.float32, "fp64": torch.float64,
          "float64": torch.float64}
_MARKS = ("SHA256SUMS",)  # what says a directory is an earlier export (safe to replace)


@dataclasses.dataclass(frozen=True)
class ExportSummary:
    """What :func:`export` wrote, from where, and what it cost."""

    step: int
    location: str
    out_dir: Path
    result: ExportResult
    bytes_read: int
    seconds: float
    skipped: tuple[str, ...]
    """Entries under the keys that are not tensors (not exported)."""


def parse_dtype(text: str | None) -> torch.dtype | None:
    """``bf16`` / ``fp16`` / ``fp32`` (and their long names) → a torch dtype; None keeps."""
    if text is None:
        return None
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise ConfigError(f"--dtype {text!r} is not a floating dtype; use one of "
                          f"{', '.join(sorted(DTYPES))}") from None


def export(source: str | Any, out_dir: Path, *, step: Step = "latest",
           keys: Sequence[str] = ("model",), format: Format = "safetensors",
           dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9,
           strip_prefix: str = "", add_prefix: str = "", hf_config: Path | None = None,
           force: bool = False, verify: VerifyMode = "chunks",
           progress: Callable[[int, int], None] | None = None) -> ExportSummary:
    """Write the tensors under ``keys`` of checkpoint ``step`` at ``source`` (a tier-1
    root, a step directory or a tier-2 URL) to ``out_dir``, committed atomically (a temp
    directory renamed), with ``SHA256SUMS``. ``hf_config``: a ``config.json`` copied in so
    ``transformers``' ``from_pretrained(out_dir)`` loads it. ``out_dir`` must not exist,
    unless ``force`` and it is an earlier export (holds ``SHA256SUMS``) or empty."""
    keys = tuple(keys)
    if not keys:
        raise ConfigError("export needs at least one key (e.g. model)")
    out_dir = Path(out_dir).expanduser().absolute()
    extra = _config_file(hf_config)
    t0 = time.perf_counter()
    with open_checkpoint(source, step=step) as ckpt:
        md = ckpt.metadata()
        require_keys(md, keys, ckpt.location)
        specs: list[TensorSpec] = []
        source_of: dict[str, str] = {}
        skipped: list[str] = []
        for fqn, entry in md.state_dict_metadata.items():
            head, _, rest = fqn.partition(".")
            if head not in keys:
                continue
            if not isinstance(entry, TensorStorageMetadata):
                skipped.append(fqn)
                continue
            name = _rename(rest if len(keys) == 1 else fqn, strip_prefix, add_prefix)
            specs.append(TensorSpec(name=name, shape=tuple(entry.size),
                                    dtype=entry.properties.dtype))
            source_of[name] = fqn
        if not specs:
            raise ConfigError(f"no tensors under {', '.join(keys)} in {ckpt.location}")
        replace = out_dir.exists() or out_dir.is_symlink()
        if replace:
            _check_replaceable(out_dir, force)
        target = out_dir.with_name(f".{out_dir.name}.new-{uuid.uuid4().hex[:8]}") \
            if replace else out_dir
        specs.sort(key=lambda sp: _file_position(md, source_of[sp.name]))  # read in order
        with RecordFetcher(ckpt, verify=verify) as fetcher:
            spans = SpanReader(fetcher, tensor_plan(md, [source_of[sp.name] for sp in specs]),
                               window=min(WINDOW, max(1 << 20, max_shard_bytes // 2)))
            result = write_hf(target, specs, lambda s: assemble(spans, md, source_of[s.name]),
                              format=format, max_shard_bytes=max_shard_bytes, dtype=dtype,
                              metadata={"tierckpt_step": str(ckpt.step)}, progress=progress,
                              extra_files=extra)
        if replace:  # the old export goes only once the new one is complete
            shutil.rmtree(out_dir)
            os.rename(target, out_dir)
            fs.fsync_dir(out_dir.parent)
        return ExportSummary(step=ckpt.step, location=ckpt.location, out_dir=out_dir,
                             result=result, bytes_read=ckpt.bytes_read,
                             seconds=time.perf_counter() - t0, skipped=tuple(skipped))


def _file_position(md: Any, fqn: str) -> tuple[str, int]:
    """Where ``fqn``'s first saved chunk is: tensors are read (and shards filled) in file
    order, so adjacent records merge into one ranged read."""
    entry = md.state_dict_metadata[fqn]
    info = md.storage_data[MetadataIndex(fqn, tuple(entry.chunks[0].offsets))]
    return (info.relative_path, info.offset)


def _rename(name: str, strip: str, add: str) -> str:
    return add + (name[len(strip):] if strip and name.startswith(strip) else name)


def _config_file(path: Path | None) -> dict[str, bytes] | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
        json.loads(data)
    except OSError as e:
        raise ConfigError(f"--hf-config {str(path)!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"--hf-config {str(path)!r} is not JSON: {e}") from None
    return {"config.json": data}


def _check_replaceable(out_dir: Path, force: bool) -> None:
    """An existing ``out_dir`` may be replaced only with ``force`` and only when it is an
    earlier export (or empty)."""
    if not force:
        raise ConfigError(f"{out_dir} already exists; pass --force (force=True) to replace "
                          "an earlier export, or choose another directory")
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise ConfigError(f"{out_dir} exists and is not a directory; not replacing it")
    if any(out_dir.iterdir()) and not any((out_dir / m).is_file() for m in _MARKS):
        raise ConfigError(f"{out_dir} is not empty and holds no SHA256SUMS, so it is not an "
                          "earlier export; not replacing it even with --force")
