"""The benchmark state: fp32 tensors of a chosen total size, shaped like a model's.

A few big tensors (embedding / output head), a band of medium ones (attention and MLP
weights) and many small ones (norms, biases), so per-tensor overheads show up the way they
do in a real checkpoint. The split over ranks is deterministic, so every rank can compute
every other rank's shard without talking to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FP32 = 4
_COLS = 1024


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its name and shape (fp32)."""

    name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * FP32


def _shape(numel: int) -> tuple[int, ...]:
    numel = max(1, numel)
    return (numel // _COLS, _COLS) if numel >= _COLS and numel % _COLS == 0 else (numel,)


def make_specs(total_bytes: int) -> list[TensorSpec]:
    """Tensor specs summing to about ``total_bytes``: 3 × 16 %, 24 × 2 %, 96 × ~0.04 %, 64 tiny."""
    total = total_bytes // FP32
    specs = [TensorSpec(name, _shape(total * 16 // 100 // _COLS * _COLS))
             for name in ("embed.weight", "head.weight", "pos.weight")]
    medium = total * 2 // 100 // _COLS * _COLS
    for layer in range(8):
        specs += [TensorSpec(f"layers.{layer}.{kind}.weight", _shape(medium))
                  for kind in ("attn_qkv", "mlp_in", "mlp_out")]
    tiny = [TensorSpec(f"layers.{i % 8}.norm{i // 8}.weight", (256,)) for i in range(64)]
    used = sum(s.nbytes for s in specs) + sum(s.nbytes for s in tiny)
    small = max(1, (total_bytes - used) // FP32 // 96)
    specs += [TensorSpec(f"layers.{i % 8}.bias{i // 8}", _shape(small)) for i in range(96)]
    return specs + tiny


def shard_specs(specs: list[TensorSpec], rank: int, world: int) -> list[TensorSpec]:
    """The specs rank ``rank`` owns: largest first, each to the lightest rank so far (LPT)."""
    loads = [0] * world
    owned: list[list[TensorSpec]] = [[] for _ in range(world)]
    for spec in sorted(specs, key=lambda s: (-s.nbytes, s.name)):
        lightest = loads.index(min(loads))
        loads[lightest] += spec.nbytes
        owned[lightest].append(spec)
    return owned[rank]


def build_state(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Allocate and fill the tensors (every page touched; value i+1 in tensor i)."""
    return {spec.name: torch.empty(spec.shape, dtype=torch.float32).fill_(float(i + 1))
            for i, spec in enumerate(specs)}


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Same names and shapes, zero-filled (pages touched): a restore target."""
    return {name: torch.zeros_like(t) for name, t in state.items()}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Total bytes of the tensors."""
    return sum(t.numel() * t.element_size() for t in state.values())


class StateModule(nn.Module):
    """The state as a module (frozen parameters), for APIs that take a model.

    Parameter names are the state's names with ``.`` replaced by ``__``; the parameters share
    storage with the given tensors, so saving the module saves exactly the same bytes.
    """

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in state.items():
            self.register_parameter(name.replace(".", "__"),
                                    nn.Parameter(tensor, requires_grad=False))
