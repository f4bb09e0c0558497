"""The peer measurements, through tierckpt's public API (``CheckpointManager``).

Same state, same ranks, same loop as ``dcp_peers``; the state is wrapped as a module of
frozen parameters (``state.StateModule``) in ``tierckpt.TrainState`` without an optimizer,
so the saved bytes are the peers' bytes plus the small per-rank blob (RNG streams, step).
(No optimizer because each rank holds differently named tensors, like pipeline stages, and
DCP de-duplicates the unflattened ``param_groups`` list across ranks: rank 0 then gets rank
1's list and ``load_state_dict`` fails. Reported to the core.) Measured per world size:

- ``blocking``: seconds ``save()`` blocks (C), after the RAM saves allocated the reusable
  host buffers (one manager serves RAM, C, durable and throughput, with increasing steps).
  Without an optimizer in the ``TrainState`` this is synchronous staging.
- ``blocking_overlap``: C with ``staging="overlap"``: the same state with an optimizer
  (SGD, lr 0, no gradients: its ``step()`` changes nothing but runs the pre-hook that
  waits for the background copy); ``save()``, then a step's compute (the bench loop) of
  twice the synchronous C, then ``optimizer.step()``. Blocked = ``save()`` + the wait in
  ``step()``; ``compute_seconds`` is what the copy could hide behind.
- ``copy_inline``: the copy limit's procedure (``limits.copy_runner``) on each rank's
  state, beside each timed save in alternating order, all ranks at once (2 copy threads
  over all ranks): C's floor in the same processes at the same time. The limit row is
  taken minutes earlier in the bench's own process, where the same copy may run at
  another speed; ``blocking.vs_copy_inline`` is C ÷ this.
- ``durable``: ``save()`` call → ``handle.durable`` resolved (committed on every rank).
- ``restore_cold``: ``restore()`` of the newest checkpoint by a fresh manager after the page
  cache dropped the shard files.
- ``own_files_read``: after each restore, the cache dropped again and every rank reads its
  own shard files of that checkpoint raw, all ranks at once, with restore's read pattern
  (``READ_STREAMS`` contiguous streams for a rank alone on its disk, else one): the
  cold-read rate the disk gives exactly those files, in their layout — restore ÷ this is
  the cost of everything a restore does besides reading.
- ``throughput``: steps/s of the loop idle, then while a save is in flight, in pairs
  (synchronous staging: no optimizer); ``throughput_overlap`` the same with the optimizer,
  i.e. the default ``staging="overlap"``: the copy runs while the loop trains.
- ``ram``: peak extra held memory (anon + shmem PSS) over ``saves`` saves, first thing in
  a fresh process.

``available()`` says whether tierckpt's manager can be imported; the bench skips this
section with that reason when it cannot.
"""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench import _dist
from bench.dcp_peers import PeerJob, summarize_ram
from bench.limits import copy_runner, read_range, timed_threads
from bench.measure import best_of, slowest_rank
from bench.memory import PeakSampler, tree_pss
from bench.pagecache import evict, files_under
from bench.state import (
    StateModule,
    build_state,
    empty_like_state,
    make_specs,
    shard_specs,
    state_bytes,
)
from bench.training import Loop, summarize_throughput


def available() -> str | None:
    """None when ``tierckpt.CheckpointManager`` and ``TrainState`` import, else the reason."""
    try:
        import tierckpt
    except ImportError as exc:
        return f"tierckpt is not importable: {exc}"
    missing = [n for n in ("CheckpointManager", "TrainState") if not hasattr(tierckpt, n)]
    return f"tierckpt has no {', '.join(missing)} yet" if missing else None


def _train_state(state: dict[str, torch.Tensor]) -> Any:
    import tierckpt

    return tierckpt.TrainState(model=StateModule(state))


def _manager(root: Path) -> Any:
    import tierckpt

    return tierckpt.CheckpointManager(tier1=root, keep_last=2)


def _ram(ckpt: Any, ts: Any, saves: int) -> dict[str, Any]:
    baseline = tree_pss()
    after = []
    with PeakSampler() as sampler:
        for step in range(saves):
            ckpt.save(step, ts).wait()
            after.append(tree_pss() - baseline)
    return {"baseline": baseline, "peak_extra": sampler.peak - baseline, "after_each": after}


def _save(ckpt: Any, ts: Any, state: dict[str, torch.Tensor] | None, first_step: int,
          repeats: int) -> dict[str, list[float]]:
    """Timed saves; the manager's buffers are already allocated by earlier saves. Given
    the ``state``, each save has beside it, in alternating order, one run of the copy
    limit's procedure on this rank's state (2 copy threads over all ranks, all ranks at
    once): C's floor measured in the process, and at the time, that C is (its buffers: one
    more state's worth of RAM while this runs)."""
    copy = None if state is None else copy_runner(state, max(1, 2 // dist.get_world_size()))
    if copy is not None:
        copy()  # warm, as the limit's first round
    blocking, durable, copies = [], [], []

    def save(step: int) -> None:
        dist.barrier()
        start = time.perf_counter()
        handle = ckpt.save(step, ts)
        handle.staged.result()
        staged = time.perf_counter() - start
        handle.wait()
        blocking.append(staged)
        durable.append(time.perf_counter() - start)

    def copy_beside(step: int) -> None:
        if copy is not None:
            dist.barrier()
            copies.append(copy())

    for r, step in enumerate(range(first_step, first_step + repeats)):
        for fn in (save, copy_beside) if r % 2 == 0 else (copy_beside, save):
            fn(step)
    out = {"blocking": blocking, "durable": durable}
    return out if copy is None else {**out, "copy_inline": copies}


def _with_optimizer(state: dict[str, torch.Tensor]) -> Any:
    """The state with an optimizer (SGD, lr 0, no gradients: its step changes nothing but
    runs the pre-hook), so saves take the default ``staging="overlap"`` path."""
    import tierckpt

    model = StateModule(state)
    return tierckpt.TrainState(model=model,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.0))


def _overlap(ckpt: Any, ts: Any, first_step: int, repeats: int,
             compute_s: float) -> dict[str, list[float]]:
    opt = ts.optimizer
    loop = Loop(seed=dist.get_rank())
    blocking, in_step, compute = [], [], []
    for step in range(first_step, first_step + repeats):
        dist.barrier()
        start = time.perf_counter()
        handle = ckpt.save(step, ts)
        returned = time.perf_counter()
        loop.run(lambda: True, min_seconds=compute_s)  # the next forward/backward
        stepping = time.perf_counter()
        opt.step()  # waits for whatever copy is left
        waited = time.perf_counter() - stepping
        handle.wait()
        blocking.append(returned - start + waited)
        in_step.append(waited)
        compute.append(stepping - returned)
    return {"blocking": blocking, "in_step": in_step, "compute": compute}


def _throughput(ckpt: Any, ts: Any, first_step: int, job: PeerJob) -> dict[str, Any]:
    loop = Loop(seed=dist.get_rank())
    idle, during = [], []
    for step in range(first_step, first_step + job.repeats):
        dist.barrier()
        idle.append(loop.idle_rate(job.loop_seconds))  # right before: same background load
        start = time.perf_counter()
        handle = ckpt.save(step, ts)
        steps, elapsed = loop.run(handle.done, start=start)
        handle.wait()
        during.append(steps / elapsed)
    return {"idle": idle, "during": during}


def _read_own_files(root: Path, rank: int, streams: int) -> float:
    """Seconds this rank takes to read its own shard files of the newest checkpoint
    (``__<rank>_*.distcp``) with ``streams`` threads, each one contiguous part front to
    back — the read pattern ``restore()`` uses (4 streams for a rank alone on its disk, 1
    per rank otherwise), without anything else it does."""
    newest = max(p for p in root.glob("step-*") if p.is_dir())
    parts = []
    for path in sorted(newest.glob(f"__{rank}_*.distcp")):
        size = path.stat().st_size
        parts += [(path, size * i // streams, size * (i + 1) // streams) for i in range(streams)]
    return timed_threads(lambda i: read_range(*parts[i]), len(parts))


def _cold(root: Path) -> dict[str, Any]:
    """Drop the page cache of every shard file under ``root`` (rank 0), all ranks in step."""
    dist.barrier()
    record = evict([p for p in files_under(root) if p.suffix == ".distcp"]).to_json() \
        if dist.get_rank() == 0 else {}
    dist.barrier()
    return record


def _restore(state: dict[str, torch.Tensor], root: Path, repeats: int) -> dict[str, Any]:
    """Cold ``restore()`` and the raw read of the same files, ``repeats`` times each, in
    alternating order: on this VM the first read after a write runs up to 3× slower (the
    host is still writing the data back), and whichever came first would take that."""
    from tierckpt.restore.reader import READ_STREAMS  # restore's read pattern

    target_state = empty_like_state(state)
    target = _train_state(target_state)
    runs, raw, evictions, bytes_read = [], [], [], 0
    streams = READ_STREAMS if dist.get_world_size() == 1 else 1

    def restore() -> None:
        nonlocal bytes_read
        evictions.append(_cold(root))
        with _manager(root) as ckpt:
            start = time.perf_counter()
            info = ckpt.restore(target)
            runs.append(time.perf_counter() - start)
        if info is None:
            raise AssertionError(f"tierckpt restore found no checkpoint in {root}")
        bytes_read = int(info.bytes_read)

    def read_raw() -> None:
        _cold(root)
        raw.append(_read_own_files(root, dist.get_rank(), streams))

    for r in range(repeats):
        for fn in (restore, read_raw) if r % 2 == 0 else (read_raw, restore):
            fn()
    name = next(iter(state))
    if not torch.equal(target_state[name], state[name]):
        raise AssertionError(f"tierckpt restore put wrong values into {name}")
    return {"runs": runs, "own_files": raw, "evictions": evictions,  # records on rank 0
            "bytes_read": bytes_read}


def tierckpt_rank(rank: int, world: int, job: PeerJob) -> dict[str, Any]:
    """Every tierckpt measurement on this rank; raw per-rank numbers."""
    warnings.filterwarnings("ignore")
    state = build_state(shard_specs(make_specs(job.size_bytes), rank, world))
    ts = _train_state(state)
    root = Path(job.target_dir) / f"tierckpt-w{world}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # steps must increase within a tier1 root
    dist.barrier()
    phases: dict[str, float] = {}
    out: dict[str, Any] = {"bytes": state_bytes(state), "phase_seconds": phases}
    start = time.perf_counter()
    with _manager(root) as ckpt:
        out["ram"] = _ram(ckpt, ts, job.saves)  # first, on a clean heap; allocates buffers
        phases["ram"] = time.perf_counter() - start
        out.update(_save(ckpt, ts, state, job.saves, job.repeats))
        phases["save"] = time.perf_counter() - start - phases["ram"]
        out["throughput"] = _throughput(ckpt, ts, job.saves + job.repeats, job)
        overlapped = _with_optimizer(state)
        out["throughput_overlap"] = _throughput(ckpt, overlapped,
                                                job.saves + 2 * job.repeats, job)
        out["overlap"] = _overlap(ckpt, overlapped, job.saves + 3 * job.repeats, job.repeats,
                                  2 * max(out["blocking"]))
    phases["throughput"] = time.perf_counter() - start - phases["ram"] - phases["save"]
    start = time.perf_counter()
    out["restore"] = _restore(state, root, job.repeats)
    phases["restore"] = time.perf_counter() - start
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank raw numbers → measurements over the whole state (JSON-ready)."""
    total = sum(r["bytes"] for r in ranks)

    def best(runs: list[list[float]], note: str) -> dict[str, Any]:
        return best_of(slowest_rank(runs), total, note).to_json()

    restore = best([r["restore"]["runs"] for r in ranks], "restore() by a fresh manager, "
                   "page cache dropped")
    restore["cold"] = all(e["honoured"] for e in ranks[0]["restore"]["evictions"])
    restore["evictions"] = ranks[0]["restore"]["evictions"]
    restore["bytes_read"] = sum(r["restore"]["bytes_read"] for r in ranks)
    own = best([r["restore"]["own_files"] for r in ranks],
               "each rank reads its own shard files of the same checkpoint, raw, one stream, "
               "all ranks at once, cache dropped (state bytes)")
    blocking = best([r["blocking"] for r in ranks], "save() blocking time (C)")
    copy = best([r["copy_inline"] for r in ranks], "the copy limit's procedure in the saving "
                "ranks, beside each timed save (2 copy threads over all ranks)")
    return {
        "bytes": total,
        "phase_seconds": ranks[0]["phase_seconds"],
        "blocking": {**blocking, "vs_copy_inline": blocking["seconds"] / copy["seconds"]},
        "copy_inline": copy,
        "durable": best([r["durable"] for r in ranks], "save() → committed on every rank"),
        "blocking_overlap": {
            **best([r["overlap"]["blocking"] for r in ranks],
                   "staging='overlap': save() + the wait in the next optimizer.step() (C)"),
            "in_step_seconds": max(max(r["overlap"]["in_step"]) for r in ranks),
            "compute_seconds": min(min(r["overlap"]["compute"]) for r in ranks)},
        "restore_cold": restore,
        "own_files_read": own,
        "throughput": summarize_throughput([r["throughput"] for r in ranks]),
        "throughput_overlap": summarize_throughput([r["throughput_overlap"] for r in ranks]),
        "ram": summarize_ram([{"bytes": r["bytes"], **r["ram"]} for r in ranks]),
    }


def measure_tierckpt(job: PeerJob, world: int) -> dict[str, Any]:
    """Every tierckpt measurement at ``world`` ranks, or ``{"skipped": reason}``."""
    reason = available()
    if reason is not None:
        return {"skipped": reason}
    return summarize(_dist.run_ranks(world, tierckpt_rank, job))
