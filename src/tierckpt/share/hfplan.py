"""The plan of a Hugging Face-style export, pure: nothing is read or written here.

Given the tensors as :class:`TensorSpec` values (names, shapes, dtypes: known before any
tensor is read), this module fixes each tensor's output dtype (:func:`output_dtype`, the
cast rule), its size once written (:func:`tensor_bytes`), the grouping into shards
(:func:`plan_shards`) and the file names ``transformers`` writes and looks for
(:func:`shard_names`, :func:`index_name`, :data:`SHA256SUMS`). Every refusal is a
:class:`ConfigError` naming what to change; the tests need values only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tierckpt.errors import ConfigError

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

# (stem, extension, index file) per format: transformers' WEIGHTS_NAME / SAFE_WEIGHTS_NAME.
_NAMES: dict[str, tuple[str, str, str]] = {
    "safetensors": ("model", ".safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model", ".bin", "pytorch_model.bin.index.json"),
}

FORMATS: tuple[str, ...] = tuple(_NAMES)
"""The formats an export writes: ``safetensors`` and ``torch``."""


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


def index_name(format: Format) -> str:
    """The index file of a sharded export, as ``save_pretrained`` names it."""
    return _NAMES[format][2]


def _check_names(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise ConfigError("nothing to write: the list of tensors is empty")
    counts = Counter(s.name for s in specs)
    dupes = sorted(name for name, n in counts.items() if n > 1)
    if dupes:
        raise ConfigError(f"duplicate tensor names (each must be written once): {dupes[:5]}")
    if "__metadata__" in counts:
        raise ConfigError("'__metadata__' is reserved by safetensors; rename that tensor")

