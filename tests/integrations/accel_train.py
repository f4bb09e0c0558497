"""An Accelerate training job (DDP on CPU/gloo under torchrun) checkpointed with
``tierckpt.integrations.accelerate``, for ``tests/integrations/test_accelerate.py``.

A small MLP with dropout, AdamW, a warmup LR schedule, gradient accumulation, a shuffled
``StatefulDataLoader`` prepared by Accelerate (seedable sampler), and a registered plain
object. The data and the initial weights come from the seeds alone, identically on every
restart. Rank 0 appends one JSON line per optimizer step to ``--losses``; ``loss_hex`` is
the bit pattern of the mean loss over ranks, ``idx`` the sample indices rank 0 trained on
in that step. ``--kill-at 9,13`` SIGKILLs ``--kill-rank`` (rank of attempt i: the i-th
entry) right after step 9 on attempt 0 and after step 13 on attempt 1, once the newest save
has committed. ``--no-cpu`` leaves out ``Accelerator(cpu=True)`` (a refusal test).
``--stop-after N`` ends the job cleanly after step N (the schedule still
spans ``--steps``). Every attempt that restores appends ``{"attempt", "step", "source"}``
to ``--restored``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tierckpt
from tierckpt import Failures, Tier2
from tierckpt.integrations.accelerate import CheckpointManager

DIM, CLASSES = 16, 4


def model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, CLASSES))


class Tracker:
    """A registered object with plain state: samples seen on this rank, and the last batch."""

    def __init__(self) -> None:
        self.samples = 0
        self.last: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "last": list(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples, self.last = state["samples"], list(state["last"])


def batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier1", required=True)
    ap.add_argument("--tier2", default=None)
    ap.add_argument("--losses", required=True)
    ap.add_argument("--restored", default=None)
    ap.add_argument("--weights-out", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--kill-at", default="")
    ap.add_argument("--kill-rank", default="1,0")
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--no-cpu", action="store_true", help="omit Accelerator(cpu=True)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = tierckpt.init_distributed(timeout=timedelta(seconds=60))
    accelerator = Accelerator(cpu=not args.no_cpu, gradient_accumulation_steps=args.accum,
                              dataloader_config=DataLoaderConfiguration(
                                  use_stateful_dataloader=True, use_seedable_sampler=True,
                                  data_seed=7))
    torch.manual_seed(0)  # same data and initial weights on every rank and every restart
    x = torch.randn(args.samples, DIM)
    y = (x[:, :CLASSES] * 2 + 0.5 * torch.randn(args.samples, CLASSES)).argmax(1)
    data = TensorDataset(x, y, torch.arange(args.samples))
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator())  # see tierckpt.state: no global draws
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    tracker = Tracker()
    accelerator.register_for_checkpointing(tracker)
    torch.manual_seed(1000 + info.rank)  # per-rank dropout streams
    kills = [int(s) for s in args.kill_at.split(",") if s]
    kill_ranks = [int(r) for r in args.kill_rank.split(",")]
    out = open(args.losses, "a") if info.rank == 0 else None  # noqa: SIM115
    tier2 = args.tier2 and Tier2(args.tier2, drain_s=60)
    with CheckpointManager(accelerator, tier1=args.tier1, tier2=tier2, every=args.every,
                           keep_last=3, failures=Failures(collective_timeout_s=60)) as ckpt:
        restored = ckpt.restore()
        if restored is not None and info.rank == 0 and args.restored:
            with open(args.restored, "a") as f:
                f.write(json.dumps({"attempt": info.restart_count, "step": restored.step,
                                    "source": restored.source}) + "\n")
        data_iter = batches(loader)
        for step in range(restored.step + 1 if restored else 0, args.steps):
            idx: list[int] = []
            for _ in range(args.accum):
                xb, yb, ib = next(data_iter)
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(xb), yb)
                    accelerator.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                idx += ib.tolist()
                tracker.samples += len(ib)
                tracker.last = ib.tolist()
            mean = float(accelerator.reduce(loss.detach(), "mean").item())
            if out is not None:
                out.write(json.dumps({
                    "step": step, "loss_hex": mean.hex(), "lr": sched.get_last_lr()[0],
                    "idx": idx, "epoch": loader.iteration, "acc_step": accelerator.step,
                    "samples": tracker.samples, "attempt": info.restart_count}) + "\n")
                out.flush()
            if ckpt.should_save(step) or step + 1 == args.steps:
                ckpt.save(step)
            attempt = info.restart_count
            if (attempt < len(kills) and step == kills[attempt]
                    and info.rank == kill_ranks[attempt % len(kill_ranks)]):
                ckpt.wait()  # a deterministic resume point: the newest save committed
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.stop_after:
                break
    if out is not None:
        out.close()
    if args.weights_out and info.rank == 0:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.weights_out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
