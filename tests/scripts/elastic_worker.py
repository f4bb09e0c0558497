"""A worker for multi-agent (multi-"node") torchrun tests on one machine.

Initialises with tierckpt.init_distributed, appends ``{"event": "ready", attempt, rank,
world_size, incarnation, tag}`` to ``<out>/records.jsonl``, then all_reduces in a loop
(checking the result) until ``<out>/stop`` exists, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tierckpt.runtime.distributed import init_distributed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    args = p.parse_args()
    info = init_distributed("gloo", timeout=timedelta(seconds=30),
                            event_log=os.path.join(args.out, "events.jsonl"))
    with open(os.path.join(args.out, "records.jsonl"), "a") as f:
        f.write(json.dumps({"event": "ready", "attempt": info.restart_count, "rank": info.rank,
                            "world_size": info.world_size, "incarnation": info.incarnation,
                            "tag": args.tag, "pid": os.getpid()}) + "\n")
    stop = os.path.join(args.out, "stop")
    expected = info.world_size * (info.world_size + 1) / 2
    while True:
        x = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(x)
        if x.item() != expected:
            return 3
        done = torch.tensor([float(os.path.exists(stop))])
        dist.all_reduce(done)  # everyone stops at the same iteration
        if done.item() > 0:
            break
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
