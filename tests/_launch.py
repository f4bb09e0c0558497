"""Launch real multi-process jobs for tests: torchrun on loopback, CPU, gloo."""

from __future__ import annotations

import functools
import gc
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tierckpt._ports import free_port

WORKLOADS = Path(__file__).parent / "workloads"


def torchrun(script: str | Path, *args: str, nproc: int = 2, max_restarts: int = 0,
             timeout: float = 240, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone`` and return the finished process.
    Raises AssertionError with the job's output when ``check`` and it failed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.2", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


#: What the fork server imports once, so that each worker forked from it starts without
#: importing torch again (~3 CPU-seconds a process here: most of a short test's cost).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "tierckpt", "tierckpt.manager"]


def spawn(fn: Callable[..., None], *args: Any, nprocs: int = 2) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and wait; raises when one
    fails. They are forked from multiprocessing's fork server, which imported
    :data:`PRELOAD` once for the whole session (no threads run there: nothing has used
    torch yet) — a real process per rank with its own gloo group and the caller's current
    environment, as a spawn gives, without paying for torch's import in each.

    Each process collects garbage once ``fn`` returns, while the interpreter is still
    whole: FSDP2 modules sit in reference cycles that hold the gloo process group, and a
    group freed during interpreter finalisation sometimes aborts the process (torch 2.13,
    CPU: "terminate called without an active exception", SIGABRT; 4 of 70 runs of a
    10-line ``fully_shard`` script, 0 of 70 with the collection)."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(functools.partial(_then_collect, fn, dict(os.environ)), args=args,
                       nprocs=nprocs, join=True, start_method="forkserver")


def _then_collect(fn: Callable[..., None], env: dict[str, str], rank: int,
                  *args: Any) -> None:
    # the environment of the test that spawned this, as a spawn would give it (the fork
    # server's is the one of the first test that used it)
    os.environ.clear()
    os.environ.update(env)
    try:
        fn(rank, *args)
    finally:
        gc.collect()


def run_ranks(script: str | Path, *args: str, nproc: int = 2,
              env: dict[str, str] | None = None) -> None:
    """Run ``script ARGS`` as ``nproc`` ranks of one job on loopback, each with the
    environment torchrun gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; one thread each, as ``OMP_NUM_THREADS=1``), forked by
    :func:`spawn`. For an uninterrupted reference run only, whose losses a test compares
    with a launched job's: it trains as under torchrun, without torchrun's agent and the
    import of torch in every rank. A test of launching, killing or restarting runs the
    launcher itself."""
    spawn(_run_script, str(script), list(args), nproc, free_port(),
          {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}, nprocs=nproc)


def _run_script(rank: int, script: str, args: list[str], world: int, port: int,
                env: dict[str, str]) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch read it at import
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{script} rank {rank} exited {e.code}") from None


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
