"""Private names of torch's core tierckpt uses outside DCP (see the package's table)."""

from __future__ import annotations

from typing import Any

import torch


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter (None for an inference tensor, which has none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def flatten_dense_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes concatenated into one flat tensor (one copy)."""
    return torch._C._nn.flatten_dense_tensors(tensors)


def adam_step_dtype(*, fused: bool | None = None) -> torch.dtype:
    """The dtype Adam-family optimizers give their ``step`` state (``fused``: the group's
    ``fused`` setting)."""
    from torch.optim.optimizer import _get_scalar_dtype

    return _get_scalar_dtype(is_fused=fused)


def default_store() -> Any:
    """The default process group's store (torch.distributed must be initialised)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()  # type: ignore[attr-defined]
