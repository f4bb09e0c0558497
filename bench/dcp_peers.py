"""Plain DCP and ``torch.save`` on the bench state: the peers tierckpt has to beat.

Each world size runs in freshly spawned gloo ranks (``_dist.run_ranks``); every rank holds
its shard of the state (``state.shard_specs``) under its own names, so DCP writes every
byte once. ``peer_rank`` returns raw per-rank timings; ``summarize`` in the parent turns them
into measurements over the whole state (a collective operation takes as long as its
slowest rank). Measured, per world size:

- ``async_default``: ``dcp.async_save`` as shipped (blocking = C, total = until durable).
- ``async_stager``: the same with one ``DefaultStager`` (shared memory) reused across saves;
  the first save (which allocates the buffers) is not timed.
- ``save_t1`` / ``save_t4``: ``dcp.save`` with ``FileSystemWriter(thread_count=1|4,
  sync_files=True)``: the durable write.
- ``torch_save_rank0``: every rank sends its tensors to rank 0, which ``torch.save``s them
  into one file and fsyncs it.
- ``load_cold``: ``dcp.load`` of the ``save_t1`` checkpoint into existing tensors after the
  page cache dropped its files.
- ``throughput``: steps/s of ``training.Loop`` idle, then while ``dcp.async_save`` runs,
  in pairs (see ``training.summarize_throughput``).
- ``ram_thread`` / ``ram_process``: peak extra held memory (anon + shmem PSS, process
  tree) over ``saves`` async saves, each on a clean heap: thread mode first thing in
  ``peer_rank``, process mode in fresh rank processes (``ram_rank``; skipped when
  ``PeerJob.process_mode`` is off).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from bench import _dist
from bench.measure import best_of, slowest_rank
from bench.memory import PeakSampler, tree_pss
from bench.pagecache import evict, files_under
from bench.state import build_state, empty_like_state, make_specs, shard_specs, state_bytes
from bench.training import Loop, summarize_throughput

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PeerJob:
    """What each rank needs: sizes, where to write, repeats, saves, loop seconds, and whether
    to measure DCP's process mode (a daemon per rank: slow to start)."""

    size_bytes: int
    target_dir: str
    repeats: int
    saves: int
    loop_seconds: float
    process_mode: bool = True


@dataclass(frozen=True)
class RamJob:
    """A RAM measurement: ``saves`` async saves in ``mode`` (``thread`` or ``process``)."""

    size_bytes: int
    target_dir: str
    saves: int
    mode: str


def _fresh(root: Path, name: str) -> Path:
    """A path under ``root`` that no earlier save used (rank 0 clears it; all ranks wait)."""
    path = root / name
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier()
    return path


def _clear(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _upload_future(result: Future[Any] | AsyncSaveResponse) -> Future[Any]:
    return result.upload_completion if isinstance(result, AsyncSaveResponse) else result


def _wait(result: Future[Any] | AsyncSaveResponse) -> None:
    _upload_future(result).result()


def _async_blocking(state: State, root: Path, repeats: int, reuse_stager: bool
                    ) -> dict[str, Any]:
    stager = DefaultStager(StagingOptions(False, True, False, False)) if reuse_stager else None
    blocking, total = [], []
    try:
        for i in range(repeats + (1 if reuse_stager else 0)):
            path = _fresh(root, f"async-{i}")
            start = time.perf_counter()
            result = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
            staged = time.perf_counter() - start
            _wait(result)
            done = time.perf_counter() - start
            _clear(path)
            if reuse_stager and i == 0:
                continue  # allocation round
            blocking.append(staged)
            total.append(done)
    finally:
        if stager is not None:
            stager.close()
    return {"blocking": blocking, "total": total}


def _sync_save(state: State, root: Path, repeats: int, threads: int, keep: bool = False
               ) -> list[float]:
    runs = []
    for i in range(repeats):
        path = _fresh(root, f"save-t{threads}" if keep else f"save-t{threads}-{i}")
        writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=True)
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        runs.append(time.perf_counter() - start)
        if not keep:
            _clear(path)
    return runs


def _gather_to_rank0(state: State, size_bytes: int, world: int) -> State:
    if dist.get_rank() != 0:
        for tensor in state.values():
            dist.send(tensor, dst=0)
        return {}
    full = dict(state)
    specs = make_specs(size_bytes)
    for src in range(1, world):
        for spec in shard_specs(specs, src, world):
            full[spec.name] = torch.empty(spec.shape, dtype=torch.float32)
            dist.recv(full[spec.name], src=src)
    return full


def _torch_save_rank0(state: State, root: Path, job: PeerJob, world: int) -> list[float]:
    runs = []
    for _ in range(job.repeats):
        path = _fresh(root, "torch-save")
        start = time.perf_counter()
        full = _gather_to_rank0(state, job.size_bytes, world)
        if dist.get_rank() == 0:
            path.mkdir(parents=True)
            with open(path / "state.pt", "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
        del full
        runs.append(time.perf_counter() - start)
        _clear(path)
    return runs


def _load_cold(state: State, root: Path, repeats: int) -> dict[str, Any]:
    path = root / "save-t1"  # written by _sync_save(keep=True)
    target = empty_like_state(state)
    runs, evictions = [], []
    for _ in range(repeats):
        dist.barrier()
        if dist.get_rank() == 0:
            evictions.append(evict(files_under(path)).to_json())
        dist.barrier()
        start = time.perf_counter()
        dcp.load(target, checkpoint_id=path)
        runs.append(time.perf_counter() - start)
    name = next(iter(state))
    if not torch.equal(target[name], state[name]):
        raise AssertionError(f"dcp.load restored wrong values into {name}")
    _clear(path)
    return {"runs": runs, "evictions": evictions}


def _throughput(state: State, root: Path, job: PeerJob) -> dict[str, Any]:
    loop = Loop(seed=dist.get_rank())
    idle, during = [], []
    for i in range(job.repeats):
        dist.barrier()
        idle.append(loop.idle_rate(job.loop_seconds))  # right before: same background load
        path = _fresh(root, f"tput-{i}")
        start = time.perf_counter()
        future = _upload_future(dcp.async_save(state, checkpoint_id=path))
        steps, elapsed = loop.run(future.done, start=start)
        future.result()
        during.append(steps / elapsed)
        _clear(path)
    return {"idle": idle, "during": during}


def _ram(state: State, root: Path, saves: int, mode: AsyncCheckpointerType) -> dict[str, Any]:
    baseline = tree_pss()
    after = []
    with PeakSampler() as sampler:
        for i in range(saves):
            path = root / f"ram-{mode.value}-{i % 2}"
            dist.barrier()
            _wait(dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=mode))
            after.append(tree_pss() - baseline)
    for i in range(2):
        _clear(root / f"ram-{mode.value}-{i}")
    return {"baseline": baseline, "peak_extra": sampler.peak - baseline, "after_each": after}


def _stop_dcp_process() -> None:
    """End DCP's per-rank checkpoint daemon now instead of at interpreter exit (private API)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        proc.__del__()
        executor._CHECKPOINT_PROCESS = None


def peer_rank(rank: int, world: int, job: PeerJob) -> dict[str, Any]:
    """Every peer measurement on this rank; raw per-rank numbers (see module docstring)."""
    warnings.filterwarnings("ignore")
    state = build_state(shard_specs(make_specs(job.size_bytes), rank, world))
    root = Path(job.target_dir) / f"dcp-w{world}"
    root.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    out: dict[str, Any] = {"bytes": state_bytes(state), "phase_seconds": phases}

    def timed(key: str, fn: Callable[[], Any]) -> None:
        start = time.perf_counter()
        out[key] = fn()
        phases[key] = time.perf_counter() - start

    # First, while the heap is clean: later saves leave freed memory resident.
    timed("ram_thread", lambda: _ram(state, root, job.saves, AsyncCheckpointerType.THREAD))
    timed("async_default", lambda: _async_blocking(state, root, job.repeats, False))
    timed("async_stager", lambda: _async_blocking(state, root, job.repeats, True))
    timed("save_t4", lambda: _sync_save(state, root, job.repeats, threads=4))
    timed("save_t1", lambda: _sync_save(state, root, job.repeats, threads=1, keep=True))
    timed("load_cold", lambda: _load_cold(state, root, job.repeats))
    timed("torch_save_rank0", lambda: _torch_save_rank0(state, root, job, world))
    timed("throughput", lambda: _throughput(state, root, job))
    _clear(root)
    return out


def ram_rank(rank: int, world: int, job: RamJob) -> dict[str, Any]:
    """One RAM measurement alone, in a fresh process: earlier saves would have left freed
    heap memory resident and hidden the staging copy from the baseline."""
    warnings.filterwarnings("ignore")
    state = build_state(shard_specs(make_specs(job.size_bytes), rank, world))
    root = Path(job.target_dir) / f"dcp-ram-w{world}"
    root.mkdir(parents=True, exist_ok=True)
    try:
        out = _ram(state, root, job.saves, AsyncCheckpointerType(job.mode))
    finally:
        _stop_dcp_process()
    _clear(root)
    return {"bytes": state_bytes(state), **out}


def summarize_ram(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank RAM records → the worst rank's peak extra and growth, as fractions of state."""
    return {
        "peak_extra_bytes": max(r["peak_extra"] for r in ranks),
        "ratio": max(r["peak_extra"] / r["bytes"] for r in ranks),
        "growth_ratio": max((r["after_each"][-1] - r["after_each"][0]) / r["bytes"]
                            for r in ranks),
        "after_each_bytes": [r["after_each"] for r in ranks],
    }


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank raw numbers → measurements over the whole state (JSON-ready)."""
    total = sum(r["bytes"] for r in ranks)

    def best(key: str, sub: str | None = None, note: str = "") -> dict[str, Any]:
        runs = slowest_rank([r[key][sub] if sub else r[key] for r in ranks])
        return best_of(runs, total, note).to_json()

    load = best("load_cold", "runs", "dcp.load into existing tensors, page cache dropped")
    load["cold"] = all(e["honoured"] for e in ranks[0]["load_cold"]["evictions"])
    load["evictions"] = ranks[0]["load_cold"]["evictions"]
    out: dict[str, Any] = {
        "bytes": total,
        "phase_seconds": ranks[0]["phase_seconds"],
        "async_default_blocking": best("async_default", "blocking", "dcp.async_save default"),
        "async_default_durable": best("async_default", "total", "dcp.async_save call → done"),
        "async_stager_blocking": best("async_stager", "blocking",
                                      "dcp.async_save, reused DefaultStager(shared memory)"),
        "save_t1": best("save_t1", note="dcp.save thread_count=1 sync_files=True"),
        "save_t4": best("save_t4", note="dcp.save thread_count=4 sync_files=True"),
        "torch_save_rank0": best("torch_save_rank0", note="gather to rank 0, torch.save, fsync"),
        "load_cold": load,
        "throughput": summarize_throughput([r["throughput"] for r in ranks]),
    }
    return out


def measure_dcp(job: PeerJob, world: int) -> dict[str, Any]:
    """Run every peer measurement at ``world`` ranks; the summarized section for the report."""
    ranks = _dist.run_ranks(world, peer_rank, job)
    out = summarize(ranks)
    out["ram_thread"] = summarize_ram([{"bytes": r["bytes"], **r["ram_thread"]} for r in ranks])
    if job.process_mode:
        ram = RamJob(size_bytes=job.size_bytes, target_dir=job.target_dir, saves=job.saves,
                     mode="process")
        out["ram_process"] = summarize_ram(_dist.run_ranks(world, ram_rank, ram))
    else:
        out["ram_process"] = {"skipped": "process mode spawns a daemon per rank (seconds); "
                                         "skipped in --quick"}
    return out
