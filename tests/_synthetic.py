"""Synthetic committed tier-1 checkpoints (random files + manifest + marker) for tests of
the layers above the saver: uploader, inventory, CLI."""

from __future__ import annotations

import random
from pathlib import Path

from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.format.parts import seal
from tierckpt.tier1 import fs


def make_checkpoint(root: Path, step: int, sizes: dict[str, tuple[int, int | None]], *,
                    domains: tuple[tuple[int, ...], ...] = (), world_size: int = 1,
                    only_ranks: set[int] | None = None, sealed: bool = False,
                    key: bytes | None = None, seed: int | None = None) -> mf.Manifest:
    """A committed tier-1 checkpoint of random files ``{name: (size, rank)}``. With
    ``only_ranks`` the directory holds just those ranks' files plus shared ones (a node).
    ``sealed``: with manifest parts, as the saver commits (:func:`~tierckpt.format.
    parts.seal`; signed with ``key``); the manifest returned then lists them. ``seed``:
    other bytes and save id for the same step (a step saved again after a rollback)."""
    rng = random.Random(step if seed is None else seed)
    d = root / layout.step_dirname(step)
    d.mkdir(parents=True)
    entries = []
    for name, (size, rank) in sizes.items():
        data = rng.randbytes(size)
        entries.append(mf.FileEntry(name=name, size=size, crc32c=checksum.extend(0, data),
                                    rank=rank))
        if only_ranks is None or rank is None or rank in only_ranks:
            fs.write_durably(d / name, data)
    m = mf.Manifest(step=step, world_size=world_size,
                    save_id=f"save{step}" + ("" if seed is None else f"-{seed}"),
                    files=tuple(entries), domains=domains)
    if sealed:
        s = seal(m, key)
        for name, data in s.parts.items():
            fs.write_durably(d / name, data)
        m, mb, marker = s.manifest, s.manifest_bytes, s.marker_bytes
    else:
        mb = m.to_bytes()
        marker = mf.marker_bytes(mb, step, m.save_id, key)
    fs.write_durably(d / layout.MANIFEST, mb)
    fs.write_durably(d / layout.COMPLETE, marker, exclusive=True)
    return m
