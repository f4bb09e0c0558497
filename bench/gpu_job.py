"""The training job behind ``bench.gpu``'s ``fsdp_resume`` section; run it under torchrun::

    python -m torch.distributed.run --standalone --nproc-per-node 1 --max-restarts 1 \\
        -m bench.gpu_job --device cuda --tier1 DIR --losses L.jsonl --meta M.jsonl --kill-at 6

A small GPT (causal attention written out, so no fused kernel picks a non-deterministic
path; dropout), ``fully_shard`` on every block and on the root, AdamW, a warmup+cosine LR
schedule, a shuffled ``StatefulDataLoader`` over ``tierckpt.ResumableSampler``, and tierckpt's
public API with its default ``staging="overlap"`` (on CUDA: the side-stream copies of the
FSDP2 shards).

Process groups: ``--device cuda`` lets ``init_distributed()`` choose ``cpu:gloo,cuda:nccl``
and ``cuda:<LOCAL_RANK>`` (NCCL refuses two ranks on one GPU, so the one-GPU run is world 1);
``--device cpu`` uses gloo. Either way the manager runs its checkpoint collectives on its own
gloo group, which ``--meta`` records.

Determinism: on CUDA, ``--deterministic`` (the default) sets ``CUBLAS_WORKSPACE_CONFIG`` before
CUDA starts and ``torch.use_deterministic_algorithms(True, warn_only=True)``, so a resumed
run can match its reference far more tightly than the drills' ``GPU_RTOL``; on CPU the
losses are bit-identical without it.

Output, rank 0 only: one JSON line per completed step to ``--losses`` (``step``, ``loss``,
``loss_hex`` = ``float.hex`` of the mean loss over ranks, ``attempt``, ``world_size``) and one
line per attempt to ``--meta`` (``attempt``, ``device``, ``backend``, ``checkpoint_backend``,
``restored_step``, ``staging``, ``deterministic``, ``torch``, ``cuda``).

``--kill-at STEP``: on attempt 0 only, after STEP's optimizer step and once the newest save
committed (a deterministic resume point), the rank SIGKILLs itself; torchrun
(``--max-restarts 1``) starts attempt 1, which restores and runs to the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

import tierckpt
from tierckpt import Failures, Writes

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 64, 4, 2


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, both with dropout."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(dropout)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.transpose(1, 2) for z in
                   self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).unbind(2))
        att = (q @ k.transpose(-2, -1)) * (d // HEADS) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(causal, float("-inf")).softmax(-1))
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, ``LAYERS`` blocks, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(tokens) + self.pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def warmup_cosine(total: int, warmup: int = 3) -> Callable[[int], float]:
    """LR multiplier: linear warmup, then cosine to 0 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_job", description=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--tier1", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--meta", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--staging", choices=("overlap", "sync"), default="overlap")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
    return p.parse_args(argv)


def _batches(loader: StatefulDataLoader) -> Iterator[torch.Tensor]:
    while True:
        yield from loader


def _log(f: TextIO | None, record: dict[str, Any]) -> None:
    if f is not None:
        f.write(json.dumps(record) + "\n")
        f.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench.gpu_job: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    deterministic = cuda and args.deterministic
    if deterministic:  # read when cuBLAS creates its handle: before any CUDA work
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    info = tierckpt.init_distributed(None if cuda else "gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)  # the same initial weights on every rank; fully_shard shards them
    model = TinyGPT().to(info.device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps))
    data = torch.randint(0, VOCAB, (512, SEQ + 1), generator=torch.Generator().manual_seed(7))
    # The loader's own generator: iter(loader) must not draw from the global RNG after a
    # restore, or every dropout mask after it would shift.
    loader = StatefulDataLoader(data, batch_size=8, num_workers=0, drop_last=True,  # type: ignore[arg-type]
                                sampler=tierckpt.ResumableSampler(data, seed=7),
                                generator=torch.Generator())
    torch.manual_seed(1000 + info.rank)  # per-rank dropout streams (CPU and CUDA)
    state = tierckpt.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    attempt = info.restart_count
    lead = info.rank == 0
    losses = open(args.losses, "a") if lead else None  # noqa: SIM115
    try:
        with tierckpt.CheckpointManager(tier1=args.tier1, keep_last=2,
                                        writes=Writes(staging=args.staging),
                                        failures=Failures(collective_timeout_s=120)) as ckpt:
            restored = ckpt.restore(state)
            if lead:
                with open(args.meta, "a") as meta:
                    _log(meta, {"attempt": attempt, "device": str(info.device),
                                "backend": str(dist.get_backend()),
                                "checkpoint_backend": str(dist.get_backend(ckpt._g.comm.group)),
                                "restored_step": restored.step if restored else None,
                                "staging": args.staging, "deterministic": deterministic,
                                "world_size": info.world_size, "torch": torch.__version__,
                                "cuda": torch.version.cuda})
            batches = _batches(loader)
            for step in range(restored.step + 1 if restored else 0, args.steps):
                batch = next(batches).to(info.device)
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()  # with a save pending, its pre-hook waits for the staging copy
                sched.step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                value = float((mean / info.world_size).item())
                _log(losses, {"step": step, "loss": value, "loss_hex": value.hex(),
                              "attempt": attempt, "world_size": info.world_size})
                if (step + 1) % args.save_every == 0:
                    ckpt.save(step, state)
                if step == args.kill_at and attempt == 0:
                    ckpt.wait()  # the resume point is the save just committed
                    os.kill(os.getpid(), signal.SIGKILL)
    finally:
        if losses is not None:
            losses.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # FSDP2 modules sit in reference cycles that hold the process group: free them while
    # the interpreter is whole, or gloo sometimes aborts the exiting process (SIGABRT)
    gc.collect()
    sys.exit(code)
