"""Preemption: notice → agreed stop → durable on each tier, and what the watcher costs a step.

Both parts run on W spawned gloo ranks (``bench._dist``) at each world size, on one node
(one tier-1 root the ranks share, one tier-0 directory on /dev/shm).

**The notice chain** — the bench state (``bench.state``, ``total_bytes`` split over the
ranks, each rank's tensors distinct) in a ``CheckpointManager`` with tier 0
(``Tier0(tier1_every=1000)``: every save after the first stays in RAM), tier 1 and tier 2
(``Tier2(upload_every=1)``; SeaweedFS on loopback, else a ``file://`` directory). A warm-up
save goes to tier 1 and is uploaded, so the job has measured both rates before the notice.
Then a lockstep loop (10 ms sleep + an ``all_reduce`` per step) where rank 0 sends itself
SIGTERM at step 5; every rank follows the loop contract (``should_save``/``should_stop``).
From the events, relative to the notice's receipt on rank 0:

- ``stop_s``: the slowest rank's ``preempt_stop`` (every rank stopped at the agreed step);
- ``tier0_s``: the emergency save committed in RAM (``save_committed``, tier 0);
- ``tier1_s``: its copy committed on tier 1 (the flush);
- ``tier2_s``: its upload verified (marker written);

and the lower bounds in the same run: ``copy_limit_s`` (one 2-thread memcpy of the state,
``limits.copy_limit``) for tier 0, the warm-up save's own tier-1 write and upload for tiers 1
and 2, so ``vs`` says how close the emergency path comes to a plain save of the same bytes.

**The watcher's cost** — a lockstep loop of calibrated ~10 ms steps (matmuls on one
thread + an ``all_reduce``), alternating blocks with a manager whose loop calls
``should_stop()`` every step (the watcher thread polls the job's store every 50 ms) and with
``Preemption`` off (no thread, no call); per block the median step; ``ratio`` = with ÷
without over all blocks (the goal: ≤ 1.01). Noise on a shared 2-core machine is of the same
order; ``spread`` is the without-blocks' own max/min.

``python -m bench.preempt [--mib 1024] [--repeats 2]``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench._cli import run_section
from bench._dist import run_ranks
from bench.state import StateModule, build_state, make_specs, shard_specs
from bench.tier0 import tier2 as tier2_url
from tierckpt import CheckpointManager, Preemption, Tier0, Tier2, TrainState
from tierckpt.format import layout
from tierckpt.runtime.events import read_events
from tierckpt.tier1.catalog import Tier1Catalog

MiB = 1 << 20
NOTICE_AT = 5
STEP_S = 0.01
WORLDS = (1, 2)


@dataclasses.dataclass(frozen=True)
class NoticeJob:
    total_bytes: int
    root: str
    shm: str
    url: str


@dataclasses.dataclass(frozen=True)
class CostJob:
    root: str
    blocks: int
    steps: int


def _notice_rank(rank: int, world: int, job: NoticeJob) -> dict[str, Any]:
    specs = shard_specs(make_specs(job.total_bytes), rank, world)
    ts = TrainState(model=StateModule(build_state(specs)))
    tick = torch.zeros(1)
    sent = None
    with CheckpointManager(tier1=job.root, tier0=Tier0(job.shm, tier1_every=1000),
                           tier2=Tier2(job.url, upload_every=1),
                           preemption=Preemption(exit_code=None, grace_s=120.0)) as ck:
        ck.save(0, ts).wait()  # the warm-up: tier 1 (the first save), then uploaded
        if rank == 0:
            cat = Tier1Catalog(Path(job.root))
            deadline = time.monotonic() + 600
            while 0 not in cat.uploads.uploaded_steps() and time.monotonic() < deadline:
                time.sleep(0.05)
        dist.barrier()
        for step in range(1, 10_000):
            time.sleep(STEP_S)
            dist.all_reduce(tick)
            if step == NOTICE_AT and rank == 0:
                sent = time.time()
                os.kill(os.getpid(), signal.SIGTERM)
            if ck.should_save(step):
                ck.save(step, ts)
            if ck.should_stop(step):
                break
    return {"sent_unix": sent, "bytes": sum(s.nbytes for s in specs)}


def _chain(root: Path, world: int) -> dict[str, Any]:
    ev = read_events(root / layout.EVENTS)
    stops = [e for e in ev if e["event"] == "preempt_stop"]
    step = stops[0]["step"]
    t0 = min(e["received_unix"] for e in ev if e["event"] == "preempt_notice")

    def at(kind: str, **match: Any) -> float | None:
        ts = [e["t"] for e in ev if e["event"] == kind and e.get("step") == step
              and all(e.get(k) == v for k, v in match.items())]
        return max(ts) - t0 if ts else None

    warm_write = next((e["write_seconds"] for e in ev if e["event"] == "save_committed"
                       and e.get("step") == 0), None)
    warm_up = next((e["seconds"] for e in ev if e["event"] == "upload_verified"
                    and e.get("step") == 0), None)
    saved = [e for e in ev if e["event"] == "preempt_saved"]
    return {
        "world": world, "step": step, "notice_step": NOTICE_AT,
        "stop_s": max(e["t"] for e in stops) - t0,
        "tier0_s": at("save_committed", tier="tier0"),
        "tier1_s": at("save_committed", flushed=True),
        "tier2_s": at("upload_verified"),
        "reached": sorted({t for e in saved for t in e["reached"]}),
        "abandoned": {k: v for e in saved for k, v in e["abandoned"].items()},
        "warm_tier1_write_s": warm_write, "warm_upload_s": warm_up,
    }


def _copy_limit_s(total_bytes: int) -> float:
    src = torch.empty(total_bytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


def measure_notice(work: Path, total_bytes: int, world: int, url: str) -> dict[str, Any]:
    root = work / f"notice-w{world}"
    shm = Path("/dev/shm") / f"tierckpt-bench-preempt-{uuid.uuid4().hex[:8]}"
    try:
        ranks = run_ranks(world, _notice_rank, NoticeJob(total_bytes, str(root), str(shm),
                                                         url))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    out = _chain(root, world)
    out["bytes"] = sum(r["bytes"] for r in ranks)
    out["copy_limit_s"] = _copy_limit_s(total_bytes)
    return out


def _calibrate() -> int:
    a = torch.randn(128, 128)
    n, t = 1, 0.0
    while t < STEP_S:
        n *= 2
        t0 = time.perf_counter()
        for _ in range(n):
            a @ a
        t = time.perf_counter() - t0
    return max(1, round(n * STEP_S / t))


def _cost_rank(rank: int, world: int, job: CostJob) -> dict[str, Any]:
    box = [_calibrate()]
    dist.broadcast_object_list(box, src=0)  # every rank runs the same step
    reps = int(box[0])
    a, tick = torch.randn(128, 128), torch.zeros(1)
    medians: dict[str, list[float]] = {"with": [], "without": []}
    for b in range(job.blocks * 2):
        mode = "with" if b % 2 == 0 else "without"
        pre = Preemption(exit_code=None) if mode == "with" else None
        with CheckpointManager(tier1=Path(job.root) / f"b{b}", preemption=pre) as ck:
            times = []
            for step in range(job.steps):
                t = time.perf_counter()
                for _ in range(reps):
                    a @ a
                dist.all_reduce(tick)
                if pre is not None and ck.should_stop(step):
                    raise AssertionError("no notice was sent")
                times.append(time.perf_counter() - t)
        medians[mode].append(statistics.median(times[5:]))
    return {"reps": reps, **medians}


def measure_cost(work: Path, world: int, *, blocks: int = 3, steps: int = 200
                 ) -> dict[str, Any]:
    ranks = run_ranks(world, _cost_rank, CostJob(str(work / f"cost-w{world}"), blocks, steps))
    on = statistics.median(v for r in ranks for v in r["with"])
    off = statistics.median(v for r in ranks for v in r["without"])
    offs = [v for r in ranks for v in r["without"]]
    return {"world": world, "with_s": on, "without_s": off, "ratio": on / off,
            "spread": max(offs) / min(offs), "blocks": blocks, "steps": steps,
            "matmuls_per_step": ranks[0]["reps"]}


def measure_preempt(work: Path, total_bytes: int, *, worlds: tuple[int, ...] = WORLDS,
                    url: str | None = None, blocks: int = 3, steps: int = 200
                    ) -> dict[str, Any]:
    """The section: ``notice`` and ``cost`` per world size (see the module docstring);
    ``blocks``/``steps``: the cost's alternating blocks and steps per block."""
    work.mkdir(parents=True, exist_ok=True)
    with tier2_url(work, url) as (remote, server):
        notice = [measure_notice(work, total_bytes, w, f"{remote.rstrip('/')}/w{w}")
                  for w in worlds]
    cost = [measure_cost(work, w, blocks=blocks, steps=steps) for w in worlds]
    return {"bytes": total_bytes, "server": server, "notice": notice, "cost": cost}


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def markdown(s: dict[str, Any]) -> list[str]:
    """The section as Markdown lines: the notice chain per world, the watcher's cost."""
    if "skipped" in s:
        return ["## Preemption", "", f"**Skipped:** {s['skipped']}", ""]
    out = ["## Preemption (same run)", "",
           f"### Notice → stop → durable ({s['bytes'] / MiB:.0f} MiB, tier 2: {s['server']})",
           "",
           "| world | agreed step | stop | tier 0 | tier 1 | tier 2 | memcpy limit | "
           "warm-up tier-1 write | warm-up upload |", "|---|---|---|---|---|---|---|---|---|"]
    for n in s["notice"]:
        out.append(f"| {n['world']} | {n['step']} (notice at {n['notice_step']}) | "
                   f"{_s(n['stop_s'])} | {_s(n['tier0_s'])} | {_s(n['tier1_s'])} | "
                   f"{_s(n['tier2_s'])} | {_s(n['copy_limit_s'])} | "
                   f"{_s(n['warm_tier1_write_s'])} | {_s(n['warm_upload_s'])} |")
    out += ["", "### The watcher's cost per ~10 ms step", "",
            "| world | with (median) | without | ratio | without's own spread |",
            "|---|---|---|---|---|"]
    for c in s["cost"]:
        out.append(f"| {c['world']} | {c['with_s'] * 1e3:.2f} ms | {c['without_s'] * 1e3:.2f} ms"
                   f" | {c['ratio']:.3f} | {c['spread']:.3f} |")
    return [*out, ""]


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.preempt``: run the section alone; print its table and JSON."""
    return run_section(argv, name="preempt", doc=__doc__, mib_help="state size in MiB",
                       markdown=markdown,
                       measure=lambda a, work: measure_preempt(work, a.mib * MiB))


if __name__ == "__main__":
    sys.exit(main())
