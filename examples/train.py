"""tierckpt's reference user: a small GPT trained with FSDP2, checkpointed and resumable.

Run it under torchrun (CPU/gloo here; CUDA/NCCL when a GPU is present)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        --max-restarts 3 examples/train.py --tier1 /tmp/run-7 --steps 60 --losses losses.jsonl

Kill any rank at any time (``kill -9``): torchrun restarts the group, the job resumes from
the newest committed checkpoint, and the per-step losses continue bit-identically to a run
that was never interrupted (on CPU). Everything it needs from tierckpt is public API:
``init_distributed``, ``StepWatchdog``, ``TrainState``, ``CheckpointManager``,
``ResumableSampler``.

What makes resume exact: the model and optimizer (FSDP2/DTensor) go through DCP; the LR
schedule, the shuffled ``StatefulDataLoader`` position and every RNG stream (dropout) are
part of ``TrainState``; the dataset is generated from ``--data-seed`` alone.

Output: rank 0 appends one JSON line per completed step to ``--losses``::

    {"step": 12, "loss": 3.71..., "loss_hex": "0x1.db...p+1", "lr": 0.0029...,
     "attempt": 1, "world_size": 2, "epoch": 0, "position": 208, "t": 1795942600.1}

``loss`` is the mean over ranks; ``loss_hex`` is its exact bit pattern (``float.hex``) so
drills compare runs bit for bit; ``epoch``/``position`` are the sampler's global position after
the step (``tierckpt.ResumableSampler``), so drills check that no sample repeats or is skipped
across a resume at another world size. Lifecycle events (process start, process group ready,
checkpoint chosen, state loaded, first step, saves, hangs) go to ``--events`` (default
``<tier1>/events.jsonl``, next to the manager's own).

``--kill-at STEP [--kill-rank R]`` is fault injection for drills and tests: on the first
attempt only, rank R SIGKILLs itself right after completing STEP, once its newest save has
committed (so the resume point is deterministic; ``tierckpt drill`` kills from outside at
arbitrary times); with ``--kill-in backward`` it dies in the middle of the next step's
backward instead, once the head's gradients exist (the survivors fail in the backward's
collectives with a half-done step in hand); ``--stall-rank S`` makes rank S stop there
too, asleep for an hour — a survivor blocked where no error reaches it, which
``tierckpt run --heal`` replaces.
``--notice-at STEP [--notice-rank R] [--notice-signal SIGTERM]``: on the first attempt, rank
R sends itself a termination notice after completing STEP; every rank then stops at the same
agreed step, saves, and exits with status 75 (preempted, saved).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import tierckpt

# --- model -----------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, both with dropout."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only language model (token + learned position embeddings)."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int,
                 dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(tokens) + self.pos[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# --- data ------------------------------------------------------------------------------------


class MarkovTokens(Dataset[torch.Tensor]):
    """``n`` token sequences of length ``seq + 1`` drawn from a fixed random Markov chain.

    Every token has ``branching`` possible successors, so the best achievable loss is
    ``ln(branching)``: the curve visibly falls from ``ln(vocab)``. Generated from ``seed``
    alone, identically on every rank and every restart.
    """

    def __init__(self, n: int, seq: int, vocab: int, seed: int, branching: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(0, vocab, (vocab, branching), generator=g)
        choice = torch.randint(0, branching, (n, seq), generator=g)
        tokens = [torch.randint(0, vocab, (n,), generator=g)]
        for t in range(seq):
            tokens.append(successors[tokens[-1], choice[:, t]])
        self.data = torch.stack(tokens, dim=1)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def warmup_cosine(total_steps: int, warmup: int,
                  min_ratio: float = 0.1) -> Callable[[int], float]:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine down to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# --- training --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tier1", required=True, help="tier-1 checkpoint directory")
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps")
    p.add_argument("--save-every", type=int, default=10, help="save after every N steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--losses", default=None, help="JSONL file for per-step losses (rank 0)")
    p.add_argument("--events", default=None, help="event log (default <tier1>/events.jsonl)")
    p.add_argument("--seed", type=int, default=0, help="model init and dropout seed")
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--samples", type=int, default=2048, help="dataset size")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a dead or hung peer fails a collective")
    p.add_argument("--hang-timeout", type=float, default=600.0,
                   help="seconds without a completed step before the watchdog exits")
    p.add_argument("--verify", default="sizes", choices=["sizes", "full"])
    p.add_argument("--tier2", default=None, help="s3://bucket/prefix or file:///path")
    p.add_argument("--upload-every", type=int, default=1, help="upload saved steps divisible by N")
    p.add_argument("--tier0", default=None,
                   help="keep checkpoints in node RAM: a tmpfs directory or 'auto'")
    p.add_argument("--tier1-every", type=int, default=1,
                   help="with --tier0: every N-th save also goes to tier 1")
    p.add_argument("--freeze-embeddings", action="store_true",
                   help="train with the token and position embeddings frozen")
    p.add_argument("--incremental", action="store_true",
                   help="Writes(incremental=True): frozen parameters are saved once")
    p.add_argument("--parallel", default="fsdp2", choices=["fsdp2", "ddp"],
                   help="how the model is spread over the ranks")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step also takes (a slower model: a scheduler test "
                        "whose time limit must cut the run whatever the machine's speed)")
    p.add_argument("--kill-at", type=int, default=None, help="fault injection: see docstring")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--kill-in", default="between", choices=["between", "backward"])
    p.add_argument("--stall-rank", type=int, default=None)
    p.add_argument("--notice-at", type=int, default=None, help="fault injection: see docstring")
    p.add_argument("--notice-rank", type=int, default=0)
    p.add_argument("--notice-signal", default="SIGTERM", choices=["SIGTERM", "SIGUSR1"])
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 1:
        p.error("--steps and --save-every must be >= 1")
    if args.dim % args.heads:
        p.error("--dim must be divisible by --heads")
    return args


def build(args: argparse.Namespace, info: tierckpt.DistInfo) -> tuple[
        GPT, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR, StatefulDataLoader]:
    """Model (FSDP2-sharded), optimizer, LR schedule and data loader, identically per rank."""
    torch.manual_seed(args.seed)  # same initial weights everywhere; fully_shard shards them
    model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads, args.dropout)
    model.to(info.device)
    if args.freeze_embeddings:  # a fine-tune of a pre-trained base: these never change
        model.tok.weight.requires_grad_(False)
        model.pos.requires_grad_(False)
    if args.parallel == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, args.warmup))
    data = MarkovTokens(args.samples, args.seq, args.vocab, args.data_seed)
    sampler = tierckpt.ResumableSampler(data, seed=args.data_seed)
    # The loader gets its own generator: iter(loader) draws a base seed from it, and drawing
    # from the global RNG after restore() would shift the dropout stream (no exact resume).
    loader = StatefulDataLoader(data, batch_size=args.batch_size, sampler=sampler,
                                num_workers=0, drop_last=True, generator=torch.Generator())
    torch.manual_seed(args.seed * 1000 + 1 + info.rank)  # per-rank dropout streams
    return model, opt, sched, loader


def batches(loader: StatefulDataLoader) -> Iterator[torch.Tensor]:
    """Endless iteration over epochs; the loader's state tracks the position."""
    while True:
        yield from loader


def die_in_backward(model: GPT) -> None:
    """SIGKILL this process in the next backward, once the gradient reaches the last block's
    output (the head's and final norm's gradients are computed by then)."""
    def hook(_m: nn.Module, _args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda _g: os.kill(os.getpid(), signal.SIGKILL))
    model.blocks[-1].register_forward_hook(hook)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    events = args.events or str(Path(args.tier1) / "events.jsonl")
    info = tierckpt.init_distributed(timeout=timedelta(seconds=args.timeout), event_log=events)
    model, opt, sched, loader = build(args, info)
    state = tierckpt.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    ddp: list[nn.Module] = []  # DDP holds its process group: wrapped again after a heal

    def wrap() -> None:
        if args.parallel == "ddp":
            # find_unused_parameters: DDP never rebuilds its gradient buckets, so the first
            # step after a restart or a heal sums gradients in the same order as every other
            # step (a fresh wrapper's first step used another layout: 1 ulp off at world 4)
            ddp[:] = [DistributedDataParallel(model, find_unused_parameters=True)]
    wrap()
    net = (lambda x: ddp[0](x)) if args.parallel == "ddp" else model
    first_run = info.restart_count == 0 and info.generation == 0  # not a restart or a heal
    losses = open(args.losses, "a") if args.losses and info.rank == 0 else None  # noqa: SIM115
    try:
        tier2 = args.tier2 and tierckpt.Tier2(args.tier2, upload_every=args.upload_every)
        tier0 = args.tier0 and tierckpt.Tier0(None if args.tier0 == "auto" else args.tier0,
                                              tier1_every=args.tier1_every)
        with tierckpt.CheckpointManager(
                tier1=args.tier1, keep_last=args.keep_last, verify=args.verify, tier2=tier2,
                tier0=tier0, failures=tierckpt.Failures(collective_timeout_s=args.timeout),
                writes=tierckpt.Writes(incremental=args.incremental),
        ) as ckpt:
            restored = ckpt.restore(state)
            start = restored.step + 1 if restored else 0
            with tierckpt.StepWatchdog(args.hang_timeout, event_log=events) as watchdog:
                data = batches(loader)
                step = start
                while step < args.steps:
                    try:
                        batch = next(data).to(info.device)
                        logits = net(batch[:, :-1])
                        loss = F.cross_entropy(logits.reshape(-1, args.vocab),
                                               batch[:, 1:].reshape(-1))
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                        if args.step_sleep > 0:
                            time.sleep(args.step_sleep)
                        lr = sched.get_last_lr()[0]
                        sched.step()
                        # the mean in rank order: an all_reduce's order of addition
                        # depends on the launcher's layout (1 ulp apart at world 3)
                        each = [torch.empty_like(loss) for _ in range(info.world_size)]
                        dist.all_gather(each, loss.detach())
                        value = float((torch.stack(each).sum() / info.world_size).item())
                        if losses is not None:
                            losses.write(json.dumps({
                                "step": step, "loss": value, "loss_hex": value.hex(),
                                "lr": lr, "attempt": info.restart_count,
                                "world_size": info.world_size, "epoch": loader.sampler.epoch,
                                "position": loader.sampler.position, "t": time.time()}) + "\n")
                            losses.flush()
                        if step == args.notice_at and first_run \
                                and info.rank == args.notice_rank:
                            os.kill(os.getpid(), signal.Signals[args.notice_signal])
                        if ((step + 1) % args.save_every == 0 or step + 1 == args.steps
                                or ckpt.should_save(step)):  # True at a notice's agreed step
                            ckpt.save(step, state)
                        stop = ckpt.should_stop(step)  # arms the notice signals (first call)
                    except RuntimeError as e:  # under `tierckpt run --heal` a peer's death:
                        step = ckpt.heal(state, e, rebuild=wrap).step + 1  # else raised again
                        data = batches(loader)  # from the restored position
                        continue
                    watchdog.step_completed(step)  # first_step after arming: a launcher
                    if stop:  # holding USR1 until first_step never hits unarmed handlers
                        break  # a notice: saved, every rank stops here
                    if step == args.kill_at and first_run and info.rank == args.kill_rank:
                        ckpt.wait()  # a deterministic resume point: the last save committed
                        if args.kill_in == "backward":
                            die_in_backward(model)
                        else:
                            os.kill(os.getpid(), signal.SIGKILL)
                    if step == args.kill_at and first_run and info.rank == args.stall_rank:
                        time.sleep(3600)  # blocked: the heal launcher must replace it
                    step += 1
    finally:
        if losses is not None:
            losses.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())  # init_distributed() frees FSDP2's cycles at exit (no SIGABRT)
