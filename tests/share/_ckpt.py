"""Real tierckpt checkpoints for the sharing tests: a small MLP + AdamW saved by a
CheckpointManager (so the optimizer state is twice the model), and ways to damage them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

import tierckpt
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.share.source import open_checkpoint
from tierckpt.tier1 import fs


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))


def save_steps(root: Path, steps: tuple[int, ...] = (1, 2), seed: int = 0
               ) -> dict[int, dict[str, torch.Tensor]]:
    """Train and save ``steps`` to tier-1 ``root``; the model's tensors at each step."""
    model = mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = tierckpt.TrainState(model=model, optimizer=opt)
    out = {}
    with tierckpt.CheckpointManager(tier1=root, keep_last=5) as mgr:
        for s in steps:
            model(torch.randn(4, 64)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(s, state).wait(60)
            out[s] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def record(root: Path, step: int, fqn: str) -> tuple[Path, int, int]:
    """``(file, offset, length)`` of the first saved record of ``fqn``."""
    with open_checkpoint(root, step=step) as ckpt:
        md = ckpt.metadata()
    info = next(i for k, i in md.storage_data.items() if k.fqn == fqn)
    return root / layout.step_dirname(step) / info.relative_path, info.offset, info.length


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def rewrite_manifest(step_dir: Path, change: object) -> None:
    """Replace the manifest with ``change(manifest)`` and re-commit the marker over it."""
    m = mf.Manifest.from_bytes((step_dir / layout.MANIFEST).read_bytes())
    mbytes = change(m).to_bytes()  # type: ignore[operator]
    fs.write_durably(step_dir / layout.MANIFEST, mbytes)
    (step_dir / layout.COMPLETE).unlink()
    fs.write_durably(step_dir / layout.COMPLETE, mf.marker_bytes(mbytes, m.step, m.save_id),
                     exclusive=True)


def drop_chunk_crcs(step_dir: Path) -> None:
    """Make ``step_dir`` look written by an older tierckpt (no per-record CRC32Cs: none
    inline in the manifest, no records files; no rank metadata files either)."""
    newer = {p.name for p in step_dir.iterdir()
             if p.name.endswith((".records", ".metadata")) and p.name != layout.METADATA}
    rewrite_manifest(step_dir, lambda m: dataclasses.replace(
        m, files=tuple(dataclasses.replace(f, chunks=()) for f in m.files
                       if f.name not in newer)))
    for name in newer:
        (step_dir / name).unlink()
