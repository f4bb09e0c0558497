"""Cost curves: C, durable write, cold restore and RAM against state size and world size.

``python -m bench.sweep`` (or ``python -m bench.run --sweep``; ``make bench
BENCH_ARGS=--sweep``). For each world size (default 1, 2, 4: spawned gloo ranks,
``bench._dist``) and each *total* state size (default 64 MiB, 256 MiB, 1 GiB, 4 GiB; each
rank holds its ``bench.state.shard_specs`` share, about size / world), one fresh set of rank
processes measures through ``tierckpt.CheckpointManager``, with ``bench.tierckpt_paths``'
helpers:

- ``C``: seconds ``save()`` blocks, after ``RAM_SAVES`` saves allocated the host buffers.
- ``durable``: ``save()`` call → ``handle.durable`` resolved (committed on every rank); split
  by the manager's own events into ``write_s`` (stage end → the slowest rank's files
  fsync'd; includes DCP's planning round trips) and ``commit_s`` (→ committed everywhere:
  the gather, broadcast and commit round trips).
- ``restore_cold``: ``restore()`` by a fresh manager after the page cache dropped the shard
  files (``bench.pagecache``; ``cold`` says whether it did).
- ``ram``: peak extra held memory (anon + shmem PSS) of each rank's process tree over its
  state during the first ``RAM_SAVES`` saves (``bench.memory``); ``ratio`` is the worst
  rank's extra ÷ its state.

Timings are the slowest rank's, best of ``repeats``. Fixed overheads are reported apart:
process start (spawn → the rank function: interpreter, imports, ``init_process_group``,
which is also given alone), manager open, and a ``FIXED_SIZE`` (1 MiB total) point per
world, run after the world's first size in the same processes (warm, as a training job's
saves are; its RAM is not reported). Per metric and world, a least-squares line
``seconds = a + bytes_per_rank / rate`` gives ``a`` (the fixed part) and ``rate``; for RAM,
``extra = a + ratio · bytes_per_rank``.
A point is skipped, with the reason, when its RAM or disk need would not fit what is free.

The fits and the planner are ``bench.sweep_fit``: ``planner_scale`` feeds C, W and R at a
stated bytes per GPU (``planner_costs``: from the first world's fits) into
``tierckpt.policy.plan`` — the functions ``tierckpt plan`` uses — for 1 to 16,384 GPUs,
with a per-GPU MTBF from Llama 3's 419 interruptions in 54 days on 16,384 GPUs. Results:
``<stamp>-sweep.json``, ``.md`` and ``.png`` (``bench.sweep_report``).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bench import _dist, sweep_report
from bench.config import GiB, MiB, parse_size, parse_worlds
from bench.dcp_peers import summarize_ram
from bench.machine import machine_facts
from bench.measure import best_of, slowest_rank
from bench.state import build_state, make_specs, shard_specs, state_bytes
from bench.sweep_fit import (
    GPU_MTBF_S,
    fit_points,
    flatness,
    planner_costs,
    planner_scale,
)
from bench.tierckpt_paths import _manager, _ram, _restore, _save, _train_state, available
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.runtime.events import SAVE_COMMITTED, SAVE_DURABLE, read_events

SCHEMA = "tierckpt-bench-sweep/1"
DEFAULT_SIZES = (64 * MiB, 256 * MiB, GiB, 4 * GiB)
DEFAULT_WORLDS = (1, 2, 4)
FIXED_SIZE = MiB
"""The tiny point whose durable and restore seconds are the per-save fixed cost."""
RAM_SAVES = 2
"""Saves under the RAM sampler, first thing in the process; they allocate the buffers."""
_RANK_RAM = 700 * MiB  # a rank process with torch and tierckpt imported, measured ~500 MiB
_RESERVE = 2 * GiB  # left free for the other people on the machine


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] sweep: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SweepJob:
    """What the ranks measure: total state sizes, in this order in the same processes;
    where to write; timed repeats; the parent's clock just before it spawned them."""

    sizes: tuple[int, ...]
    target_dir: str
    repeats: int
    spawned_unix: float


def _phases(root: Path, steps: range) -> dict[str, list[float]]:
    """Per timed step, from the manager's events: write (slowest rank's stage end → fsync'd)
    and commit (the rest, until committed on every rank)."""
    evs = read_events(root / layout.EVENTS)
    out: dict[str, list[float]] = {"write_s": [], "commit_s": []}
    for step in steps:
        wrote = max(e["seconds"] for e in evs if e["event"] == SAVE_DURABLE and e["step"] == step)
        done = max(e["write_seconds"] for e in evs
                   if e["event"] == SAVE_COMMITTED and e["step"] == step)
        out["write_s"].append(wrote)
        out["commit_s"].append(max(0.0, done - wrote))
    return out


def _rank_point(rank: int, world: int, size: int, job: SweepJob) -> dict[str, Any]:
    """One size on this rank: RAM first, then timed saves, then cold restores."""
    state = build_state(shard_specs(make_specs(size), rank, world))
    ts = _train_state(state)
    root = Path(job.target_dir) / f"sweep-w{world}-{size}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    start = time.perf_counter()
    ckpt = _manager(root)
    out: dict[str, Any] = {"bytes": state_bytes(state),
                           "manager_open_seconds": time.perf_counter() - start}
    with ckpt:
        out["ram"] = _ram(ckpt, ts, RAM_SAVES)
        out.update(_save(ckpt, ts, None, RAM_SAVES, job.repeats))  # no copy beside: RAM
    del ckpt  # its host buffers go before the restore target is allocated
    gc.collect()
    out["restore"] = _restore(state, root, job.repeats)
    dist.barrier()
    if rank == 0:
        out["phases"] = _phases(root, range(RAM_SAVES, RAM_SAVES + job.repeats))
        shutil.rmtree(root, ignore_errors=True)
    return out


def sweep_rank(rank: int, world: int, job: SweepJob) -> dict[str, Any]:
    """Every size of ``job`` on this rank, in order; ``start_seconds`` is spawn → here
    (interpreter, imports, process group)."""
    started = time.time() - job.spawned_unix
    warnings.filterwarnings("ignore")
    return {"start_seconds": started,
            "points": [_rank_point(rank, world, size, job) for size in job.sizes]}


def _summarize(ranks: list[dict[str, Any]], world: int, index: int) -> dict[str, Any]:
    mine = [r["points"][index] for r in ranks]
    total = sum(r["bytes"] for r in mine)

    def best(runs: list[list[float]], note: str) -> dict[str, Any]:
        return best_of(slowest_rank(runs), total, note).to_json()

    evictions = mine[0]["restore"]["evictions"]
    restore = {**best([r["restore"]["runs"] for r in mine], "fresh manager, cache dropped"),
               "cold": all(e["honoured"] for e in evictions), "evictions": evictions}
    phases = mine[0]["phases"]
    return {
        "world": world, "bytes": total, "bytes_per_rank": max(r["bytes"] for r in mine),
        "C": best([r["blocking"] for r in mine], "save() blocking (C)"),
        "durable": best([r["durable"] for r in mine], "save() → committed on every rank"),
        "restore_cold": restore,
        "own_files_read": best([r["restore"]["own_files"] for r in mine],
                               "each rank reads its own shard files raw, all at once, cold"),
        "ram": summarize_ram([{"bytes": r["bytes"], **r["ram"]} for r in mine]),
        "write_s": min(phases["write_s"]), "commit_s": min(phases["commit_s"]),
        "manager_open_seconds": max(r["manager_open_seconds"] for r in mine),
        "pg_init_seconds": max(r["pg_init_seconds"] for r in ranks),
        "start_seconds": max(r["start_seconds"] for r in ranks),
    }


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def room_for(size: int, world: int, work: Path) -> str | None:
    """None when a point fits what is free now, else why not. RAM: state + host buffers +
    restore target (3 × size) + a process per rank + a reserve; disk: two kept
    checkpoints and the one being written (3 × size)."""
    need, avail = 3 * size + world * _RANK_RAM + _RESERVE, _mem_available()
    if need > avail:
        return (f"needs about {need / GiB:.1f} GiB of RAM (3 × state + {world} × "
                f"{_RANK_RAM / GiB:.1f} GiB per rank + {_RESERVE / GiB:.0f} GiB reserve); "
                f"{avail / GiB:.1f} GiB available")
    free = shutil.disk_usage(work).free
    if 3 * size + _RESERVE > free:
        return f"needs about {(3 * size + _RESERVE) / GiB:.1f} GiB of disk in {work}; " \
               f"{free / GiB:.1f} GiB free"
    return None


def _check(sizes: tuple[int, ...], worlds: tuple[int, ...], repeats: int) -> None:
    if not sizes:
        raise ConfigError("sizes: give at least one total state size, e.g. --sizes 64MiB,256MiB")
    small = [s for s in sizes if s < MiB]
    if small:
        raise ConfigError(f"sizes: {small[0]} bytes is below 1 MiB; every sweep point needs "
                          "at least 1MiB of state (e.g. --sizes 1MiB,64MiB)")
    if not worlds or any(w < 1 or w > 8 for w in worlds):
        raise ConfigError(f"worlds {list(worlds)}: give world sizes between 1 and 8, e.g. 1,2,4")
    if repeats < 1:
        raise ConfigError(f"repeats must be ≥ 1, got {repeats}")


def _run(work: Path, sizes: tuple[int, ...], world: int, repeats: int,
         errors: list[str]) -> list[dict[str, Any]]:
    """``sizes`` in one set of fresh rank processes; a failure marks each point skipped."""
    label = " + ".join(f"{s / MiB:.0f} MiB" for s in sizes)
    _log(f"world {world}, {label} ...")
    start = time.perf_counter()
    try:
        ranks = _dist.run_ranks(world, sweep_rank, SweepJob(sizes, str(work), repeats,
                                                            time.time()))
    except Exception as exc:  # record and go on: the other points still count
        traceback.print_exc()
        errors.append(f"world {world}, {label}: {exc!r}")
        return [{"world": world, "size_bytes": s, "skipped": f"failed: {exc!r}"} for s in sizes]
    wall = time.perf_counter() - start
    points = [{"size_bytes": s, **_summarize(ranks, world, i)} for i, s in enumerate(sizes)]
    points[0]["wall_seconds"] = wall
    for p in points:
        _log(f"world {world}, {p['size_bytes'] / MiB:.0f} MiB: C {p['C']['seconds']:.3f} s, "
             f"durable {p['durable']['seconds']:.3f} s, restore "
             f"{p['restore_cold']['seconds']:.3f} s, RAM {p['ram']['ratio']:.2f}×")
    _log(f"world {world}, {label} done in {wall:.0f} s")
    return points


def measure_sweep(work: Path, sizes: tuple[int, ...] = DEFAULT_SIZES,
                  worlds: tuple[int, ...] = DEFAULT_WORLDS, repeats: int = 1
                  ) -> dict[str, Any]:
    """Every point, the fixed overheads and the fits (see the module docstring).

    ``sizes``: total state bytes (each ≥ 1 MiB); ``worlds``: 1..8. A point that fails is
    recorded with its error (``errors``) and the sweep goes on. Raises ConfigError for bad
    input before anything runs.
    """
    sizes, worlds = tuple(sorted(set(sizes))), tuple(dict.fromkeys(worlds))
    _check(sizes, worlds, repeats)
    reason = available()
    if reason is not None:
        raise ConfigError(f"the sweep needs tierckpt's manager: {reason}")
    work.mkdir(parents=True, exist_ok=True)
    points: list[dict[str, Any]] = []
    fixed: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for world in worlds:
        for size in sizes:
            reason = room_for(size, world, work)
            if reason is not None:
                _log(f"world {world}, {size / MiB:.0f} MiB: skipped ({reason})")
                points.append({"world": world, "size_bytes": size, "skipped": reason})
                continue
            # The 1 MiB point rides in the processes of the world's first measured size,
            # after it (its RAM is not reported; the first size's is on a clean heap).
            tail = () if str(world) in fixed else (FIXED_SIZE,)
            got = _run(work, (size, *tail), world, repeats, errors)
            points.append(got[0])
            if tail:
                fixed[str(world)] = got[1]
        if str(world) not in fixed:
            fixed[str(world)] = _run(work, (FIXED_SIZE,), world, repeats, errors)[0]
    fits = fit_points(points, worlds)
    return {"sizes": list(sizes), "worlds": list(worlds), "repeats": repeats,
            "points": points, "fixed": fixed,
            "pg_init_seconds": _per_spawn(points, fixed, "pg_init_seconds"),
            "process_start_seconds": _per_spawn(points, fixed, "start_seconds"),
            "fits": fits, "flatness": flatness(points, fits), "errors": errors}


def _per_spawn(points: list[dict[str, Any]], fixed: dict[str, Any], key: str
               ) -> dict[str, float]:
    """Median of ``key`` (slowest rank) over each set of rank processes of a world."""
    by_world: dict[str, list[float]] = {}
    for p in [*points, *fixed.values()]:
        if "wall_seconds" in p:  # the first point of each spawn
            by_world.setdefault(str(p["world"]), []).append(p[key])
    return {w: statistics.median(v) for w, v in by_world.items()}


# --------------------------------------------------------------------------------- CLI


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"64MiB,256MiB"`` → bytes; ConfigError naming ``--sizes`` for a bad or small one."""
    out = []
    for part in filter(None, (s.strip() for s in text.split(","))):
        try:
            out.append(parse_size(part))
        except ConfigError:
            raise ConfigError(f"--sizes: {part!r} is not a size of at least 1 MiB; write "
                              "comma-separated sizes, e.g. 64MiB,256MiB,1GiB") from None
    if not out:
        raise ConfigError(f"--sizes {text!r}: give at least one size, e.g. 64MiB,256MiB")
    return tuple(out)


REPEATS = 2
"""Timed repeats per point: two, so that the restore and the raw read of its files each get
one turn that is not the first read after the write (``tierckpt_paths._restore``)."""


def run_sweep(*, sizes: str | None, world: str | None, out: Path, target: Path,
              repeats: int = REPEATS) -> int:
    """Measure, plan, write ``<stamp>-sweep.{json,md,png}`` into ``out``; the exit status
    (0 all points ran or were skipped for room, 1 a point failed, 2 bad arguments)."""
    try:
        size_list = parse_sizes(sizes) if sizes else DEFAULT_SIZES
        worlds = parse_worlds(world) if world else DEFAULT_WORLDS
        _check(size_list, worlds, repeats)
    except ConfigError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    work = target / f"sweep-{time.strftime('%H%M%S')}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        facts = machine_facts(work)
        results = measure_sweep(work, size_list, worlds, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    costs = planner_costs(results)
    results = {"schema": SCHEMA, "started": started,
               "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "wall_seconds": time.perf_counter() - t0, "machine": facts, **results,
               "planner": costs if "skipped" in costs else {
                   **costs, "gpu_mtbf_s": GPU_MTBF_S,
                   "rows": planner_scale(costs["C_s"], costs["R_s"], costs["W_s"])}}
    paths = sweep_report.write_sweep(results, out, started.replace(":", ""))
    print("\n".join(sweep_report.render_markdown(results).splitlines()[2:]))
    print("results: {}\ntable:   {}\nplot:    {}".format(*paths))
    for e in results["errors"]:
        print(f"bench: sweep point failed: {e}", file=sys.stderr)
    return 1 if results["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.sweep``: parse, then :func:`run_sweep`."""
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help="comma-separated total state sizes "
                                    "(default 64MiB,256MiB,1GiB,4GiB)")
    ap.add_argument("--world", help="comma-separated world sizes (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats per point (best)")
    ap.add_argument("--out", type=Path, default=repo / "bench" / "results")
    ap.add_argument("--target", type=Path, default=repo / "bench" / "out",
                    help="directory on the filesystem under test (removed afterwards)")
    a = ap.parse_args(argv)
    return run_sweep(sizes=a.sizes, world=a.world, out=a.out, target=a.target,
                     repeats=a.repeats)


if __name__ == "__main__":
    sys.exit(main())
