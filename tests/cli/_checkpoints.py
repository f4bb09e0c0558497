"""Real tier-1 checkpoints for the checkpoint commands: a tiny model saved by
``tierckpt.CheckpointManager`` in this process, copied from a template per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

import tierckpt
from tests._synthetic import make_checkpoint
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.tier2.uploader import Uploader, UploaderConfig, UploadResult


def train_state(seed: int = 0) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierckpt.TrainState(model=model, optimizer=opt, extra={"tokens": 0})


def save_steps(root: Path, steps: list[int], *, seed: int = 0) -> None:
    """Commit one checkpoint per step under ``root`` (keeping all of them)."""
    st = train_state(seed)
    with tierckpt.CheckpointManager(tier1=root, keep_last=1000) as ck:
        for s in steps:
            assert st.extra is not None
            st.extra["tokens"] = s
            ck.save(s, st).wait(60)


def clone(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest)
    return dest


def manifest(root: Path, step: int) -> mf.Manifest:
    d = root / layout.step_dirname(step)
    return mf.verify_marker((d / layout.COMPLETE).read_bytes(),
                            (d / layout.MANIFEST).read_bytes())


def shard(root: Path, step: int) -> Path:
    """The largest DCP shard file of a tier-1 checkpoint."""
    m = manifest(root, step)
    name = max((f for f in m.files if f.rank is not None), key=lambda f: f.size).name
    return root / layout.step_dirname(step) / name


def flip_byte(path: Path, offset: int = 100) -> None:
    """Corrupt one byte in place (same size: only a CRC32C check can notice)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def upload(root: Path, tier2: str, *, every: int = 1, steps: list[int] | None = None,
           keep_last: int = 100) -> list[UploadResult]:
    """Run the uploader in-process: ``drain()``, or exactly ``steps`` in order (counting
    the root's commits for ``every`` as ``tierckpt upload`` does)."""
    with Uploader(UploaderConfig(tier1=root, tier2=tier2, upload_every=every,
                                 keep_last=keep_last, count_commits=True)) as up:
        if steps is None:
            return up.drain()
        return [up.upload_step(s) for s in steps]



def node_local_checkpoint(root: Path, step: int, sizes: dict[str, tuple[int, int | None]],
                          *, domains: tuple[tuple[int, ...], ...], world_size: int,
                          only_ranks: set[int]) -> mf.Manifest:
    """A committed checkpoint of random files ``{name: (size, rank)}`` of which this root
    holds only ``only_ranks``' files plus the shared ones (one node of several)."""
    return make_checkpoint(root, step, sizes, domains=domains, world_size=world_size,
                           only_ranks=only_ranks)
