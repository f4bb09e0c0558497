"""A torchtitan-style training job (FSDP2 over gloo, CPU, under torchrun) checkpointed by
``tierckpt.integrations.torchtitan``, for ``tests/integrations/test_torchtitan.py``.

It builds what torchtitan's ``Trainer.__init__`` builds, with torchtitan's own classes where
they run on CPU — ``OptimizersContainer`` (AdamW, from ``default_adamw``),
``LRSchedulersContainer`` (warmup, then linear decay), a ``ParallelAwareDataloader`` over a
stateful token stream, a train state with ``step`` and ``ntokens_seen`` like the Trainer's,
``clip_grad_norm_`` — and builds the checkpointer the way ``trainer.py`` does
(``config.checkpoint.build(...)``). The model is a small decoder (embedding, residual MLP
blocks with dropout, ``fully_shard`` per block) instead of llama3, whose import needs triton.
The loop calls what ``Trainer.train``/``train_step`` call, in their order::

    load(step=-1); loop { step += 1; zero_grad; forward/backward; clip_grad_norm_;
                          maybe_wait_for_staging(); optimizers.step(); lr_schedulers.step();
                          save(step, last_step=step == steps) }; close()

Rank 0 appends one JSON line per step to ``--losses``: ``loss_hex`` is the bit pattern of
the mean loss over ranks. ``--kill-at K`` SIGKILLs rank ``--kill-rank`` right after step K
on attempt 0, once the newest save has committed (``maybe_wait_for_saving``).
``--stop-after N`` ends cleanly after step N (``close()`` drains tier 2). Every attempt that
restores appends ``{"attempt", "step", "source"}`` to ``--restored``; ``--weights-out``
gets the final full model state dict (rank 0). ``--stock`` checkpoints with torchtitan's
own ``CheckpointManager`` instead (synchronous DCP; for a comparison by hand).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.distributed.utils import clip_grad_norm_

import tierckpt
from tierckpt.integrations.torchtitan import tierckpt_config

VOCAB, DIM, SEQ = 64, 32, 16


class Decoder(nn.Module):
    """torchtitan's naming (tok_embeddings, layers.<i>, norm, output), MLP blocks."""

    def __init__(self, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(dropout) for i in range(layers)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.w2(F.gelu(self.w1(self.norm(x)))))  # type: ignore[no-any-return]


class Tokens(IterableDataset):  # type: ignore[type-arg]
    """An endless stream of (input, labels) pairs, sample i a function of (seed, rank, i);
    ``Stateful`` like torchtitan's ``HuggingFaceTextDataset`` (its position is saved)."""

    def __init__(self, seed: int, dp_rank: int) -> None:
        self.seed, self.dp_rank, self.sample_idx = seed, dp_rank, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dp_rank * 7919
                                              + self.sample_idx)
            start = torch.randint(0, VOCAB, (1,), generator=g)
            step = torch.randint(1, 4, (1,), generator=g)
            noise = (torch.rand(SEQ + 1, generator=g) < 0.1).long()
            seq = (start + step * torch.arange(SEQ + 1) + noise) % VOCAB
            self.sample_idx += 1
            yield {"input": seq[:-1]}, seq[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample_idx = int(state["sample_idx"])


class TrainCounters:
    """What ``Trainer.state_dict`` holds: the step and the tokens seen."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def model_fn(dropout: float = 0.1) -> Decoder:
    torch.manual_seed(0)  # same initial weights on every rank and every restart
    return Decoder(dropout=dropout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier1", required=True)
    ap.add_argument("--tier2", default=None)
    ap.add_argument("--tier0", default=None)
    ap.add_argument("--losses", required=True)
    ap.add_argument("--restored", default=None)
    ap.add_argument("--weights-out", default=None)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--interval", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--stock", action="store_true",
                    help="torchtitan's own CheckpointManager instead (for comparison)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # torchtitan's own init_distributed skips a group that exists; tierckpt's survives
    # torchrun restarts on gloo (docs/restarts.md)
    info = tierckpt.init_distributed(timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (info.world_size,), mesh_dim_names=("dp_shard",))
    model = model_fn(args.dropout)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model_parts = [model]
    optimizers = dataclasses.replace(default_adamw(lr=1e-2), implementation="for-loop"
                                     ).build(model_parts=model_parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=args.steps)
    dataloader = ParallelAwareDataloader(
        Tokens(seed=5, dp_rank=info.rank), dp_rank=info.rank, dp_world_size=info.world_size,
        batch_size=4, generator=torch.Generator())  # its own generator: see tierckpt.state
    counters = TrainCounters()
    common = {"enable": True, "interval": args.interval, "keep_latest_k": 3,
              "enable_first_step_checkpoint": True}
    checkpoint = (CheckpointManager.Config(**common, folder=args.tier1,
                                           last_save_model_only=False) if args.stock else
                  tierckpt_config(**common, tier1=args.tier1, tier2=args.tier2, tier0=args.tier0,
                                  collective_timeout_s=60, upload_drain_s=60))
    checkpointer = checkpoint.build(
        dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
        lr_schedulers=lr_schedulers, states={"train_state": counters}, sd_adapter=None,
        base_folder="")
    torch.manual_seed(1000 + info.rank)  # per-rank dropout streams
    out = open(args.losses, "a") if info.rank == 0 else None  # noqa: SIM115
    try:
        checkpointer.load(step=-1)
        restored = getattr(checkpointer, "restored", None)
        if restored is not None and info.rank == 0 and args.restored:
            with open(args.restored, "a") as f:
                f.write(json.dumps({"attempt": info.restart_count,
                                    "step": restored.step,
                                    "source": restored.source}) + "\n")
        data_iter = iter(dataloader)
        while counters.step < args.steps:
            counters.step += 1
            step = counters.step
            optimizers.zero_grad()
            inputs, labels = next(data_iter)
            counters.ntokens_seen += labels.numel()
            logits = model(inputs["input"])
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            clip_grad_norm_([p for p in model.parameters()], max_norm=1.0, foreach=True)
            checkpointer.maybe_wait_for_staging()
            optimizers.step()
            lr_schedulers.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if out is not None:
                out.write(json.dumps({
                    "step": step, "loss_hex": (mean.item() / info.world_size).hex(),
                    "lr": lr_schedulers.schedulers[0].get_last_lr()[0],
                    "ntokens_seen": counters.ntokens_seen,
                    "attempt": info.restart_count}) + "\n")
                out.flush()
            checkpointer.save(step, last_step=step == args.steps)
            if info.restart_count == 0 and step == args.kill_at and info.rank == args.kill_rank:
                checkpointer.maybe_wait_for_saving()  # a deterministic resume point
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.stop_after:
                break
    except Exception:
        checkpointer.close()  # as torchtitan's train.py: closes as after an error
        raise
    checkpointer.close()
    if out is not None:
        out.close()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if args.weights_out and info.rank == 0:
        torch.save(full, args.weights_out)
    dist.destroy_process_group()
    # torch 2.13, CPU: a process that used FSDP2 over gloo sometimes aborts while the
    # interpreter finalises ("terminate called without an active exception", SIGABRT, no
    # Python frame), with or without any checkpointer: 2 of 25 runs of a 10-line fully_shard
    # script, 0 of 25 with this line. Everything is written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
