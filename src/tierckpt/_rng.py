"""Capture, restore and deterministically re-derive every RNG stream of a process:
Python ``random``, NumPy's global generator, torch CPU and every CUDA device.

States are converted to plain types (tuples, lists, ints, tensors) so they load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import numpy.random  # here, not in the first save() (14 ms of its blocking time)
import torch


def capture() -> dict[str, Any]:
    """Snapshot every RNG stream of this process."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    name, keys, pos, has_gauss, cached = np_state
    state: dict[str, Any] = {
        "python": _python_state(),
        "numpy": (str(name), torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
                  int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every stream back exactly as :func:`capture` saw it."""
    random.setstate(_python_restore(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def rederive(source: dict[str, Any], *, step: int, rank: int, world_size: int) -> int:
    """Seed every stream from a value derived from the saved state of the source rank, the
    step and this process's (rank, world_size); returns the seed. Used when the world size
    changed: the streams cannot continue, but they restart deterministically."""
    h = hashlib.sha256()
    h.update(bytes(source["torch"].numpy().tobytes()))
    h.update(f"{step}:{rank}:{world_size}".encode())
    seed = int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    return seed


def _python_state() -> tuple[int, torch.Tensor, float | None]:
    """``random.getstate()`` with its 625 words as one tensor: one object to pickle instead
    of 625 (the per-rank blob is serialised inside ``save()``, on the blocking path)."""
    version, words, gauss = random.getstate()
    return version, torch.tensor(words, dtype=torch.int64), gauss


def _python_restore(saved: Any) -> Any:
    """The state for ``random.setstate`` from :func:`_python_state`'s form, or from the
    plain tuple that older checkpoints hold (loaded as nested lists)."""
    version, words, gauss = saved
    if isinstance(words, torch.Tensor):
        return version, tuple(int(w) for w in words.tolist()), gauss
    return _as_tuple(saved)


def _as_tuple(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return tuple(_as_tuple(v) for v in x)
    return x
