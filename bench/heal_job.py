"""The training job of ``bench.heal``: an FSDP2 model of ``--mib`` MiB of state (parameters
and two Adam moments, 12 bytes per parameter) in four square layers, built on the meta
device and initialised shard by shard (as FSDP2 jobs at scale are), a one-row batch (the
step's cost is the optimizer's, not the matmuls'), a save every ``--save-every`` steps, and
the heal loop of examples/train.py. Rank 0 appends ``{"step", "t"}`` per step to
``--steps-log``. Run it under ``tierckpt run --heal`` or torchrun."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import tierckpt


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tier1", required=True)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--steps-log", required=True)
    args = p.parse_args()
    info = tierckpt.init_distributed(timeout=timedelta(seconds=60),
                                     event_log=f"{args.tier1}/events.jsonl")
    n = int(math.sqrt(args.mib * (1 << 20) / 12 / 4))
    with torch.device("meta"):  # built as FSDP2 jobs at scale build: shard, then allocate
        model = nn.Sequential(*(nn.Linear(n, n, bias=False) for _ in range(4)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():  # each rank initialises its own shards
        for i, param in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(1000 * i + info.rank)
            param.to_local().uniform_(-1 / math.sqrt(n), 1 / math.sqrt(n), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = tierckpt.TrainState(model=model, optimizer=opt)
    log = open(args.steps_log, "a") if info.rank == 0 else None  # noqa: SIM115
    x = torch.ones(1, n)
    with tierckpt.CheckpointManager(tier1=args.tier1, keep_last=2) as ckpt:
        restored = ckpt.restore(state)
        step = restored.step + 1 if restored else 0
        while step < args.steps:
            try:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if (step + 1) % args.save_every == 0:
                    ckpt.save(step, state)
            except RuntimeError as e:
                step = ckpt.heal(state, e).step + 1
                continue
            if log is not None:
                log.write(json.dumps({"step": step, "t": time.time()}) + "\n")
                log.flush()
            step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
