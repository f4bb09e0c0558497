"""Copy a state dict into host buffers that are allocated once and reused across saves.

Staging is the only part of a save that blocks training (it is C). Each tensor gets its own
contiguous host buffer (pinned when CUDA is available), keyed by its path in the state dict
and reused while shape and dtype stay the same, so steady-state saves allocate nothing.
DTensors keep their sharding: the local shard is staged and re-wrapped with the same mesh and
placements, which is what DCP's planner needs to write the shard without gathering.
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

Path = tuple[str | int, ...]
_PIECE_BYTES = 8 * 1024 * 1024


class HostStager:
    """Owns the reusable host buffers of one :class:`CheckpointManager`.

    ``stage(sd)`` returns ``(staged_sd, nbytes)``: a structure like ``sd`` whose tensors are
    host copies that stay valid until the next ``stage`` call (the caller must not stage
    again while a background write still reads them). Non-tensor leaves are deep-copied.
    """

    def __init__(self, *, pin_memory: bool | None = None, copy_threads: int | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[Path, torch.Tensor] = {}
        self.allocations = 0  # buffers (re)allocated since construction; steady state: 0/save
        # Host-to-host copies run on our own threads (torch's copy releases the GIL), so C
        # reaches memory bandwidth even when the job runs torch with one thread per rank.
        self.copy_threads = copy_threads or min(8, os.cpu_count() or 1)
        self._pool = (ThreadPoolExecutor(self.copy_threads, thread_name_prefix="tierckpt-stage")
                      if self.copy_threads > 1 else None)
        self._jobs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def close(self) -> None:
        """Stop the copy threads. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def nbytes(self) -> int:
        """Host bytes held in staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, sd: Any) -> tuple[Any, int]:
        seen: set[Path] = set()
        counter = [0]
        self._jobs = []
        staged = self._walk(sd, (), seen, counter)
        self._run_copies()
        for stale in set(self._buffers) - seen:  # keys that disappeared: free their buffers
            del self._buffers[stale]
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # non_blocking D2H copies must land before writing
        return staged, counter[0]

    def _walk(self, obj: Any, path: Path, seen: set[Path], counter: list[int]) -> Any:
        if isinstance(obj, DTensor):
            local = self._copy(obj.to_local(), path, seen, counter)
            return DTensor.from_local(local, obj.device_mesh, obj.placements,
                                      run_check=False, shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._copy(obj, path, seen, counter)
        if isinstance(obj, dict):
            return {k: self._walk(v, (*path, k), seen, counter) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v, (*path, i), seen, counter) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._walk(v, (*path, i), seen, counter) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy(self, t: torch.Tensor, path: Path, seen: set[Path],
              counter: list[int]) -> torch.Tensor:
        seen.add(path)
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                              pin_memory=self.pin_memory and t.is_cuda)
            self._buffers[path] = buf
            self.allocations += 1
        if t.is_cuda or self._pool is None:
            buf.copy_(t, non_blocking=t.is_cuda)
        else:
            self._jobs.append((buf, t))
        counter[0] += buf.numel() * buf.element_size()
        return buf

    def _run_copies(self) -> None:
        """Copy the queued host tensors in ~8 MiB pieces spread over the copy threads."""
        jobs, self._jobs = self._jobs, []
        if not jobs:
            return
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in jobs:
            n = dst.numel()
            step = max(1, _PIECE_BYTES // max(1, dst.element_size()))
            if n <= step or not src.is_contiguous():
                pieces.append((dst, src))
                continue
            d, s = dst.view(-1), src.reshape(-1)
            pieces.extend((d[i:i + step], s[i:i + step]) for i in range(0, n, step))
        assert self._pool is not None
        for _ in self._pool.map(lambda ds: ds[0].copy_(ds[1]), pieces):
            pass
