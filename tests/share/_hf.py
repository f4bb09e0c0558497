"""Tensors and readers the Hugging Face export tests share (plan, shard files, commit)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests._require import require
from tierckpt.share.hfplan import TensorSpec

try:
    import safetensors.torch as st
    HAVE_SAFETENSORS = True
except ImportError:  # pragma: no cover - the share extra is missing
    HAVE_SAFETENSORS = False


def need_safetensors() -> None:
    require(HAVE_SAFETENSORS, "needs safetensors (pip install 'tierckpt[share]')")


def mixed() -> dict[str, torch.Tensor]:
    """Every kind of tensor a training checkpoint holds, with their sizes in bytes."""
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),          # f32, 512
        "model.layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),  # bf16, 128
        "model.step": torch.tensor(12345678901, dtype=torch.int64),             # 0-d i64, 8
        "model.mask": torch.rand(5, 3, generator=g) > 0.5,                      # bool, 15
        "model.empty": torch.empty(0, 4),                                       # f32, 0
        "model.ids": torch.randint(-2**40, 2**40, (7,), generator=g),           # i64, 56
        "lm_head.weight": torch.randn(4, 8, generator=g),                       # f32, 128
    }


# max_shard_bytes=200: the 512-byte embedding alone; then 128+8+15+0 = 151, and 56 more
# would exceed 200; then 56+128 = 184.
PLAN_200 = [["model.embed_tokens.weight"],
            ["model.layers.0.w", "model.step", "model.mask", "model.empty"],
            ["model.ids", "lm_head.weight"]]


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]


def reader(tensors: dict[str, torch.Tensor]) -> Callable[[TensorSpec], torch.Tensor]:
    return lambda spec: tensors[spec.name].clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(_bits(got), _bits(want)), name


def load_all(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of an export via the reference loader, and which file held it."""
    loaded: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in sorted(out.glob("*.safetensors")):
        for k, v in st.load_file(f).items():
            assert k not in loaded
            loaded[k], where[k] = v, f.name
    return loaded, where
