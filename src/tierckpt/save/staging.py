"""Copy a state dict into host buffers that are allocated once and reused across saves.

Staging is the only part of a save that can block training (it is C). Each tensor gets its
own contiguous host buffer (pinned when CUDA is available), keyed by its path in the state
dict and reused while shape and dtype stay the same, so steady-state saves allocate nothing.
DTensors keep their sharding: the local shard is staged and re-wrapped with the same mesh and
placements, which is what DCP's planner needs to write the shard without gathering.

Two modes (``Writes(staging=...)``):

- ``stage(sd)`` copies everything before it returns (``"sync"``).
- ``stage(sd, defer=...)`` copies only what ``defer`` rejects before it returns; the rest —
  parameters and optimizer state, which change only in ``optimizer.step()`` — is copied in
  the background while the next forward/backward runs (``"overlap"``). The returned
  :class:`Staged` has a ``ready`` future that resolves once every copy landed; the caller
  waits for it before anything may change those tensors (the manager's optimizer step
  pre-hook) and before the buffers are written. Each deferred source's autograd version
  counter is read when the copy is queued and again after it landed: an in-place change in
  between (a write outside ``optimizer.step()``) fails ``ready`` with
  :class:`StagingRaceError` instead of saving a torn tensor.

Kept tensors (``stage(sd, keep=...)``, for ``Writes(incremental=True)``): a tensor ``keep``
accepts (a frozen parameter) is copied at once, never deferred, and its signature — storage
address, autograd version counter, shape, strides, dtype, device — is remembered once the
copy landed. At the next ``stage`` a kept tensor with the same signature is not copied
again: its buffer still holds those bytes (``refresh=True`` copies them all: a full save).
:attr:`Staged.frozen` names every kept tensor by its DCP key, :attr:`Staged.kept` those not
copied this time.
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tierckpt._runs import contiguous_runs
from tierckpt._torch.core import tensor_version
from tierckpt.errors import StagingRaceError
from tierckpt.tier1.directio import ZERO_COPY_MIN

Path = tuple[str | int, ...]
_ATOMIC = frozenset({int, float, bool, str, bytes, type(None), complex})  # copies are moot
_PIECE_BYTES = 8 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Staged:
    """What :meth:`HostStager.stage` returns: the host copy of the state dict (same
    structure; valid until the next ``stage``), its byte count, the bytes still being
    copied in the background, and ``ready`` — resolved with the seconds the background
    copies took (0.0 when there were none) or failed with :class:`StagingRaceError`."""

    tree: Any
    nbytes: int
    deferred_bytes: int
    ready: Future[float]
    frozen: frozenset[str] = frozenset()
    """The DCP keys (``model.<fqn>``) of the tensors ``keep`` accepted."""
    kept: frozenset[str] = frozenset()
    """Those of :attr:`frozen` not copied this time: unchanged since their last copy."""
    kept_bytes: int = 0


def _page_aligned(shape: torch.Size, dtype: torch.dtype, nbytes: int) -> torch.Tensor | None:
    """An uninitialised CPU tensor that owns exactly ``nbytes`` of page-aligned memory (an
    anonymous mapping), or None when torch cannot wrap one for ``dtype``."""
    try:
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
    except (TypeError, ValueError, RuntimeError):
        return None


class HostStager:
    """Owns the reusable host buffers of one :class:`CheckpointManager`.

    The caller must not stage again while a background write (or the previous ``ready``)
    still uses the buffers. Non-tensor leaves are deep-copied at ``stage`` time.
    """

    def __init__(self, *, pin_memory: bool | None = None, copy_threads: int | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[Path, torch.Tensor] = {}
        self._signatures: dict[Path, tuple[Any, ...]] = {}  # kept tensors' last copies
        self.allocations = 0  # buffers (re)allocated since construction; steady state: 0/save
        # Host-to-host copies run on our own threads (torch's copy releases the GIL), so C
        # reaches memory bandwidth even when the job runs torch with one thread per rank.
        self.copy_threads = copy_threads or min(8, os.cpu_count() or 1)
        self._pool = (ThreadPoolExecutor(self.copy_threads, thread_name_prefix="tierckpt-stage")
                      if self.copy_threads > 1 else None)
        # Background staging: one coordinator that runs (or fans out) the deferred copies.
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-stage-bg")
        self._streams: dict[torch.device, Any] = {}  # per device: deferred D2H copies

    def close(self) -> None:
        """Stop the copy threads (after any background copy finished). Idempotent."""
        self._background.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def nbytes(self) -> int:
        """Host bytes held in staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, sd: Any, *, defer: Callable[[Path, torch.Tensor], bool] | None = None,
              keep: Callable[[Path, torch.Tensor], bool] | None = None,
              refresh: bool = False) -> Staged:
        """Copy ``sd`` into the host buffers. With ``defer``, tensors for which it returns
        True (given their path and the tensor; a DTensor's local shard) are copied in the
        background; everything else before this returns. With ``keep``, a tensor it accepts
        is copied only when it changed since its last copy, or with ``refresh`` (see the
        module docstring)."""
        walk = _Walk(self, defer, keep, refresh)
        tree = walk.visit(sd, ())
        for stale in set(self._buffers) - walk.seen:  # keys that disappeared: free them
            del self._buffers[stale]
        for path in set(self._signatures) - walk.kept_paths:  # copied again (or gone)
            del self._signatures[path]
        self._copy_now(walk.now, walk.now_cuda)
        self._signatures.update(walk.signatures)  # those copies landed
        ready: Future[float]
        if walk.later or walk.later_cuda:
            ready = self._copy_later(walk.later, walk.later_cuda)
        else:
            ready = Future()
            ready.set_result(0.0)
        return Staged(tree, walk.nbytes, walk.deferred_bytes, ready, frozenset(walk.frozen),
                      frozenset(walk.kept), walk.kept_bytes)

    # -- copies ---------------------------------------------------------------------------
    def buffer(self, path: Path, t: torch.Tensor) -> torch.Tensor:
        """The reusable host buffer for ``t`` at ``path`` (allocated on first use; large
        ones page-aligned, so the shard writer can write them without another copy)."""
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pinned = self.pin_memory and t.is_cuda
            nbytes = t.numel() * t.element_size()
            buf = (_page_aligned(t.shape, t.dtype, nbytes)
                   if not pinned and nbytes >= ZERO_COPY_MIN else None)
            if buf is None:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
            self._buffers[path] = buf
            self.allocations += 1
        return buf

    def _copy_now(self, jobs: list[tuple[torch.Tensor, torch.Tensor]],
                  cuda_jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in cuda_jobs:
            dst.copy_(src, non_blocking=True)
        done = []  # per device, behind its copies on the stream they were queued on
        for device in dict.fromkeys(src.device for _, src in cuda_jobs):
            event = torch.cuda.Event(blocking=True)
            event.record(torch.cuda.current_stream(device))
            done.append(event)
        self._run_copies(jobs)
        for event in done:  # the D2H copies landed (not every stream: torch.cuda.synchronize
            event.synchronize()  # would also wait for other streams' work, e.g. NCCL)

    def _copy_later(self, jobs: list[tuple[torch.Tensor, torch.Tensor]],
                    cuda_jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> Future[float]:
        started = time.monotonic()
        versions = [tensor_version(src) for _, src in (*jobs, *cuda_jobs)]
        events = []
        for device in dict.fromkeys(src.device for _, src in cuda_jobs):
            # per device: a side stream queued behind the work issued so far on it
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for dst, src in cuda_jobs:
                    if src.device == device:
                        src.record_stream(stream)
                        dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the waiter sleeps, not spins
                event.record(stream)
                events.append(event)

        def run() -> float:
            self._run_copies(jobs)
            for event in events:
                event.synchronize()
            for (_, src), before in zip((*jobs, *cuda_jobs), versions, strict=True):
                if before is not None and tensor_version(src) != before:
                    raise StagingRaceError(
                        "a tensor staged in the background (shape "
                        f"{tuple(src.shape)}, {src.dtype}) was changed in place before its "
                        "copy landed: with Writes(staging='overlap'), parameters and optimizer "
                        "state may change only in optimizer.step() until the copy is done; "
                        "use Writes(staging='sync') if the loop writes them elsewhere")
            return time.monotonic() - started
        return self._background.submit(run)

    def _run_copies(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy host tensors in ~8 MiB pieces spread over the copy threads, the pieces
        handed out in a few batches of about equal bytes (a transformer's state is hundreds
        of small tensors: one hand-off each cost more than their copies)."""
        if not jobs:
            return
        if self._pool is None:
            _copy_all(jobs)
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
        batches = contiguous_runs(pieces, 2 * self.copy_threads,
                                  lambda p: p[0].numel() * p[0].element_size())
        for _ in self._pool.map(_copy_all, batches):
            pass


def _copy_all(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pieces:
        dst.copy_(src)


class _Walk:
    """One pass over a state dict: the host-side structure, and the copies to run now or
    later, split by ``defer`` and by device."""

    def __init__(self, stager: HostStager, defer: Callable[[Path, torch.Tensor], bool] | None,
                 keep: Callable[[Path, torch.Tensor], bool] | None = None,
                 refresh: bool = False) -> None:
        self.stager, self.defer, self.keep, self.refresh = stager, defer, keep, refresh
        self.seen: set[Path] = set()
        self.nbytes = self.deferred_bytes = self.kept_bytes = 0
        self.frozen: list[str] = []
        self.kept: list[str] = []
        self.kept_paths: set[Path] = set()  # kept tensors not copied this time
        self.signatures: dict[Path, tuple[Any, ...]] = {}  # kept tensors copied this time
        self.now: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.now_cuda: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.later_cuda: list[tuple[torch.Tensor, torch.Tensor]] = []

    def visit(self, obj: Any, path: Path) -> Any:
        if isinstance(obj, DTensor):
            local = self.tensor(obj.to_local(), path)
            return DTensor.from_local(local, obj.device_mesh, obj.placements,
                                      run_check=False, shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if type(obj) in _ATOMIC:
            return obj
        if isinstance(obj, dict):
            return {k: self.visit(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            if all(type(v) in _ATOMIC for v in obj):  # e.g. param_groups' "params": a copy
                return list(obj) if isinstance(obj, list) else obj
            if isinstance(obj, list):
                return [self.visit(v, (*path, i)) for i, v in enumerate(obj)]
            return tuple(self.visit(v, (*path, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def tensor(self, t: torch.Tensor, path: Path) -> torch.Tensor:
        self.seen.add(path)
        if t.requires_grad:  # (state dicts hold detached tensors: detach() costs µs each)
            t = t.detach()
        buf = self.stager.buffer(path, t)
        size = buf.numel() * buf.element_size()
        self.nbytes += size
        if self.keep is not None and self.keep(path, t):
            return self._kept(t, path, buf, size)
        later = self.defer is not None and self.defer(path, t)
        if later:
            self.deferred_bytes += size
        queue = (self.later_cuda if t.is_cuda else self.later) if later else \
            (self.now_cuda if t.is_cuda else self.now)
        queue.append((buf, t))
        return buf

    def _kept(self, t: torch.Tensor, path: Path, buf: torch.Tensor, size: int) -> torch.Tensor:
        """A tensor ``keep`` accepted: not copied when unchanged since its last copy, else
        copied now (its signature remembered once the copy landed)."""
        self.frozen.append(_dcp_key(path))
        sig = _signature(t)
        if sig is not None and not self.refresh and self.stager._signatures.get(path) == sig:
            self.kept.append(_dcp_key(path))
            self.kept_paths.add(path)
            self.kept_bytes += size
            return buf
        if sig is not None:
            self.signatures[path] = sig
        (self.now_cuda if t.is_cuda else self.now).append((buf, t))
        return buf


def _signature(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What an in-place write (other than through ``.data``) or a new tensor changes: the
    storage address, the version counter, the layout; None for a tensor without a version
    counter (an inference tensor: always copied)."""
    version = tensor_version(t)
    if version is None:
        return None
    return (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype, t.device)


def _dcp_key(path: Path) -> str:
    """The key DCP flattens ``path`` to (``("model", "0.weight")`` → ``model.0.weight``)."""
    return ".".join(str(p) for p in path)
