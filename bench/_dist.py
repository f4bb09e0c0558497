"""Run one function on W spawned gloo ranks and collect what each rank returns.

Each rank gets ``MASTER_ADDR=127.0.0.1``, a free port, one intra-op thread, a gloo process
group, and returns a JSON-able dict; the parent receives the list ordered by rank, each with
``pg_init_seconds`` (this rank's ``init_process_group``) added unless ``fn`` set it. A rank's
exception fails the whole call (``torch.multiprocessing`` re-raises it).

One torch thread per rank at every world size (torchrun's default for multi-rank jobs): with
two OpenMP threads the training loop's step rate swung 10× between consecutive seconds on a
shared 2-core machine (spinning threads descheduled), which made throughput ratios noise.
Parallel staging therefore has to come from the library's own threads, as the 2-thread
copy limit assumes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierckpt._ports import free_port

J = TypeVar("J")
RankFn = Callable[[int, int, J], dict[str, Any]]


def _entry(rank: int, world: int, port: int, fn: RankFn[J], job: J, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    start = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pg_init = time.perf_counter() - start
    try:
        result = fn(rank, world, job)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result.setdefault("pg_init_seconds", pg_init)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(world: int, fn: RankFn[J], job: J) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, job)`` on ``world`` spawned processes; results ordered by rank."""
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as out:
        mp.start_processes(_entry, args=(world, free_port(), fn, job, out), nprocs=world,
                           join=True, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
