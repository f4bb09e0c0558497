"""One incarnation of a torchrun job that is killed and restarted on purpose.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node W --max-restarts N``.
Every attempt initialises the process group, checks three all_reduce results, and appends one
JSON line per stage to ``<out>/records.jsonl``. While fewer than ``--kill-until`` kills are
recorded there, rank ``kills % W`` SIGKILLs itself after the first all_reduce (its peers then
fail in the next collective and torchrun restarts the whole group); the last attempt finishes
cleanly. Kills are counted from the records, not from ``TORCHELASTIC_RESTART_COUNT``, because
that count is per agent and differs between nodes in multi-agent runs.

``--mode`` chooses how the process group starts:
  tierckpt        tierckpt.init_distributed (the fix)
  plain           dist.init_process_group("gloo", timeout=...) (torch's env:// path)
  restart-prefix  init_process_group on PrefixStore("attempt-<TORCHELASTIC_RESTART_COUNT>")
The last two exist only to measure the problem; the tests use ``tierckpt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _record(out: str, **fields: object) -> None:
    line = json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(os.path.join(out, "records.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _count_kills(out: str) -> int:
    path = os.path.join(out, "records.jsonl")
    with open(path) as f:
        return sum(json.loads(line)["stage"] == "killing" for line in f if line.strip())


def _init(mode: str, timeout: timedelta, events: str | None) -> None:
    if mode == "tierckpt":
        from tierckpt.runtime.distributed import init_distributed

        init_distributed("gloo", timeout=timeout, event_log=events)
    elif mode == "plain":
        dist.init_process_group("gloo", timeout=timeout)
    elif mode == "restart-prefix":
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        prefix = f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}"
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank,
                                world_size=world, timeout=timeout)
    else:
        raise SystemExit(f"unknown --mode {mode!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-until", type=int, required=True)
    p.add_argument("--mode", default="tierckpt")
    p.add_argument("--timeout", type=float, default=20.0, help="PG timeout, seconds")
    p.add_argument("--events", default=None, help="tierckpt event log (mode tierckpt)")
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    base = {"attempt": attempt, "rank": rank}
    _record(args.out, stage="start", **base)
    t0 = time.monotonic()
    try:
        _init(args.mode, timedelta(seconds=args.timeout), args.events)
    except Exception as e:
        _record(args.out, stage="init_failed", error=f"{type(e).__name__}: {e}"[:300], **base)
        raise
    _record(args.out, stage="pg_ready", seconds=time.monotonic() - t0, **base)

    # Read before the first all_reduce: no rank can record a kill until all ranks are in it.
    kills = _count_kills(args.out)
    expected = world * (world + 1) // 2
    for i in range(3):
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        if x.item() != expected:
            _record(args.out, stage="wrong_result", value=x.item(), **base)
            return 3
        if i == 0 and kills < args.kill_until and rank == kills % world:
            _record(args.out, stage="killing", **base)
            os.kill(os.getpid(), signal.SIGKILL)
    _record(args.out, stage="done", **base)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
