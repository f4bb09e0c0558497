"""A small FSDP2 transformer training job for the core tests (run under torchrun).

Real parts only: gloo process group, ``fully_shard`` on every block, dropout, AdamW, a
warmup+cosine LR schedule, a shuffled ``StatefulDataLoader`` over deterministic synthetic
tokens, and tierckpt's public API. Rank 0 appends ``{"step", "loss", "attempt"}`` per step to
``--losses`` (loss is the global mean, so it does not depend on the world size).

Fault hooks for tests: ``--kill-at STEP`` SIGKILLs ``--kill-rank`` on the first attempt after
that step's optimizer step (between saves unless STEP is a save step, in which case the kill
lands while the background write is in flight).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

import tierckpt
from tierckpt import Failures, Tier0, Tier2
from tierckpt.runtime.distributed import init_distributed

VOCAB, SEQ, DIM = 64, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(tok) + self.pos)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def dataset(n: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)


def lr_lambda(total: int, warmup: int = 3):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return f


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {"model": msd, "optim": osd.get("state", {})}  # empty on ranks > 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier1", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--losses", required=True)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--kill-after-commit", action="store_true",
                    help="before the kill, wait until the in-flight save is committed")
    ap.add_argument("--dump-restored", default=None, help="rank 0 saves full state after restore")
    ap.add_argument("--dump-saved", default=None, help="rank 0 saves full state at last save")
    ap.add_argument("--verify", default="sizes")
    ap.add_argument("--tier2", default=None)
    ap.add_argument("--upload-every", type=int, default=1)
    ap.add_argument("--tier0", default=None, help="tier-0 root ({node} as in --tier1)")
    ap.add_argument("--tier1-every", type=int, default=1)
    ap.add_argument("--no-replicate", action="store_true")
    args = ap.parse_args()

    info = init_distributed(timeout=timedelta(seconds=60))
    rank, world = info.rank, info.world_size
    torch.manual_seed(0)  # same init on every rank; FSDP shards it
    model = TinyGPT()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps))
    data = dataset()
    # The loader gets its own generator: creating an iterator must not draw from the global
    # RNG, or the draw after a restore would shift every dropout mask that follows.
    loader = StatefulDataLoader(data, batch_size=4, num_workers=0, generator=torch.Generator(),
                                sampler=tierckpt.ResumableSampler(data, seed=7))
    torch.manual_seed(100 + rank)  # per-rank dropout streams
    state = tierckpt.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader,
                                extra={"samples": 0})
    attempt = info.restart_count
    # "{node}" in --tier1 becomes this node's rank: one tier-1 root per (simulated) node
    node = os.environ.get("GROUP_RANK", "0")
    tier1 = args.tier1.format(node=node)
    tier0 = args.tier0.format(node=node) if args.tier0 else None
    tier2 = args.tier2 and Tier2(args.tier2, upload_every=args.upload_every)
    # keep_on_close: the tests look at each node's RAM (and its partner's replica) after a run
    tier0_cfg = tier0 and Tier0(None if tier0 == "auto" else tier0, keep_on_close=True,
                                tier1_every=args.tier1_every, replicate=not args.no_replicate)
    with tierckpt.CheckpointManager(tier1=tier1, keep_last=3, verify=args.verify, tier2=tier2,
                                    tier0=tier0_cfg,
                                    failures=Failures(collective_timeout_s=30)) as ckpt:
        restored = ckpt.restore(state)
        if restored and rank == 0 and args.dump_restored:
            torch.save({"step": restored.step, **full_state(model, opt)}, args.dump_restored)
        elif restored and args.dump_restored:
            full_state(model, opt)  # collective
        start = restored.step + 1 if restored else 0
        it = iter(loader)
        for step in range(start, args.steps):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            state.extra["samples"] += batch.shape[0]
            g = loss.detach().clone()
            dist.all_reduce(g)
            if rank == 0:
                with open(args.losses, "a") as f:
                    f.write(json.dumps({"step": step, "loss": (g / world).item(),
                                        "attempt": attempt, "world": world}) + "\n")
            if (step + 1) % args.save_every == 0:
                ckpt.save(step, state)
                if args.dump_saved and step + args.save_every >= args.steps:
                    fs = full_state(model, opt)
                    if rank == 0:
                        torch.save({"step": step, **fs}, args.dump_saved)
            if step == args.kill_at and attempt == 0 and rank == args.kill_rank:
                if args.kill_after_commit:
                    ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # FSDP2 modules sit in reference cycles that hold the process group: free them while
    # the interpreter is whole, or gloo sometimes aborts the exiting process (SIGABRT)
    gc.collect()
