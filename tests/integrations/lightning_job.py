"""A 2-rank Lightning job for ``test_lightning.py``, launched with torchrun (CPU, gloo).

A small MLP with dropout (so the per-rank RNG matters), AdamW with a per-step ``StepLR``, a
shuffled map-style ``StatefulDataLoader`` (Lightning swaps its ``RandomSampler`` for a
``DistributedSampler``; the loader has its own ``generator``, so creating an iterator never
draws from the global RNG), ``seed_everything``, two validation batches after every third
training batch; the user-facing part is marked USER.

Each rank appends one JSON line per optimizer step to ``<out>/rows.<rank>.jsonl``: step,
loss and lr bit patterns (``float.hex``), epoch, batch index, the sample ids of the batch,
a stateful callback's count (its state must round-trip) and the torchrun attempt. At train
start rank 0 writes ``<out>/restored.<attempt>.json`` (what tierckpt restored); at the end
each rank writes its final weights to ``<out>/final.<rank>.pt`` (DDP).

``--strategy modelparallel``: FSDP2 (``fully_shard`` in ``configure_model``) under
``TierckptModelParallelStrategy``. ``--kill-at S``: on the first attempt, rank
``--kill-rank`` waits for its newest save to commit and SIGKILLs itself before the batch
after optimizer step S (a deterministic resume point). ``--model-checkpoint``: a Lightning
``ModelCheckpoint`` alongside. ``--validate``: after fit, load the newest checkpoint into a
freshly initialised model with ``trainer.validate(ckpt_path="tierckpt")`` and write
``<out>/eval.<rank>.json``. ``--refit-without-resume``: then ``fit`` again without
``ckpt_path`` and write the error it raises to ``<out>/refit.<rank>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import tierckpt
from tierckpt import Failures, Tier2
from tierckpt.integrations.lightning import (
    RESUME,
    TierckptCheckpoint,
    TierckptDDPStrategy,
    TierckptModelParallelStrategy,
)

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Points(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """``n`` points of a fixed random 4-class problem, generated from ``seed`` alone."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


class Net(pl.LightningModule):
    def __init__(self, samples: int, lr: float = 0.02, shard: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
        self.last: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.hparams.shard:  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        loss = F.cross_entropy(self.net(x), y)
        self.last = {"loss": loss.item(), "ids": ids.tolist()}
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _loader(self) -> StatefulDataLoader:
        # USER: sampler=RandomSampler (not shuffle=True, which makes torchdata's own sampler,
        # whose order Lightning's DistributedSamplerWrapper would draw from an unsaved
        # generator): Lightning swaps in a DistributedSampler, ordered by seed and epoch.
        # generator=: creating an iterator after a restore must not draw the global RNG.
        data = Points(self.hparams.samples)
        return StatefulDataLoader(data, batch_size=4, sampler=RandomSampler(data),
                                  generator=torch.Generator(), num_workers=0)

    def train_dataloader(self) -> StatefulDataLoader:
        return self._loader()

    def val_dataloader(self) -> StatefulDataLoader:
        return self._loader()


class Record(pl.Callback):
    """Writes a row per optimizer step; its count is callback state that must round-trip."""

    def __init__(self, out: Path) -> None:
        self.out, self.batches = out, 0

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        info = trainer.strategy.restored  # type: ignore[attr-defined]
        if trainer.global_rank == 0:
            (self.out / f"restored.{ATTEMPT}.json").write_text(json.dumps(
                None if info is None else {"step": info.step, "source": info.source}))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.batches += 1
        row = {"step": trainer.global_step, "loss": pl_module.last["loss"].hex(),
               "lr": trainer.optimizers[0].param_groups[0]["lr"].hex(),
               "epoch": trainer.current_epoch, "batch_idx": batch_idx,
               "ids": pl_module.last["ids"], "batches": self.batches, "attempt": ATTEMPT}
        with open(self.out / f"rows.{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


class KillAt(pl.Callback):
    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if ATTEMPT == 0 and trainer.global_step == self.step and trainer.global_rank == self.rank:
            trainer.strategy.manager.wait()  # type: ignore[attr-defined]
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tier1", required=True)
    p.add_argument("--tier2", default=None)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--strategy", choices=["ddp", "modelparallel"], default="ddp")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--model-checkpoint", action="store_true",
                   help="also a Lightning ModelCheckpoint writing .ckpt files to <out>/pl")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--refit-without-resume", action="store_true",
                   help="after fit, fit again without ckpt_path; write <out>/refit.<rank>.json")
    args = p.parse_args()

    pl.seed_everything(7, workers=True)
    trainer = make_trainer(args)
    model = Net(args.samples, shard=args.strategy == "modelparallel")
    trainer.fit(model, ckpt_path=RESUME)  # USER: resume from tier 1 or tier 2, or start fresh
    rank = trainer.global_rank
    state = trainer.strategy._state  # one TrainState across saves: keys derived once
    (args.out / f"capture.{rank}.json").write_text(json.dumps(
        {} if state is None else {"calls": state.model_state.capture.calls,
                                  "reference_calls": state.model_state.capture.reference_calls}))
    if args.strategy == "ddp":
        torch.save(model.state_dict(), args.out / f"final.{rank}.pt")
    if args.validate:
        pl.seed_everything(99)
        fresh = Net(args.samples)
        assert not torch.equal(fresh.net[0].weight, model.net[0].weight)
        trainer.validate(fresh, ckpt_path=RESUME, verbose=False)
        same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                     model.state_dict().values(), strict=True))
        (args.out / f"eval.{rank}.json").write_text(json.dumps({"same_weights": same}))
    if args.refit_without_resume:
        try:
            make_trainer(args, record=False).fit(Net(args.samples))
            error = None
        except tierckpt.ConfigError as e:
            error = str(e)
        (args.out / f"refit.{rank}.json").write_text(json.dumps({"error": error}))
    return 0


def make_trainer(args: argparse.Namespace, record: bool = True) -> pl.Trainer:
    # --- USER: what a Lightning user adds --------------------------------------------------
    config = tierckpt.ManagerConfig(tier1=args.tier1,
                                    tier2=args.tier2 and Tier2(args.tier2, drain_s=60),
                                    keep_last=3, failures=Failures(collective_timeout_s=60))
    strategy: TierckptDDPStrategy | TierckptModelParallelStrategy
    if args.strategy == "ddp":
        strategy = TierckptDDPStrategy(tierckpt=config, process_group_backend="gloo",
                                       timeout=timedelta(seconds=60))
    else:
        strategy = TierckptModelParallelStrategy(tierckpt=config, data_parallel_size=2,
                                                 tensor_parallel_size=1,
                                                 timeout=timedelta(seconds=60))
    callbacks: list[pl.Callback] = [
        TierckptCheckpoint(every_n_steps=args.save_every, hang_timeout=args.hang_timeout)]
    # ----------------------------------------------------------------------------------------
    if record:
        callbacks.append(Record(args.out))
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at, args.kill_rank))
    if args.model_checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=args.out / "pl", every_n_train_steps=5,
                                         save_top_k=-1))
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                      max_steps=args.max_steps, callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=3)


if __name__ == "__main__":
    code = main()
    # FSDP2 modules sit in reference cycles that hold the process group: free them while
    # the interpreter is whole, or gloo sometimes aborts the exiting process (SIGABRT)
    gc.collect()
    sys.exit(code)
