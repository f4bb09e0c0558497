"""Planted ``.metadata`` pickles: what anyone who can write a committed tier-1 checkpoint —
its manifest and marker included — could leave there for the next restore to unpickle."""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
from pathlib import Path
from typing import Literal

from torch.distributed.checkpoint.metadata import MetadataIndex

from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.format.parts import seal
from tierckpt.restore.metadata import load_metadata
from tierckpt.tier1 import fs

Where = Literal["top", "storage_data", "planner_data"]
REFUSED = "pathlib.Path.touch"
"""The global every payload here names (what a refusal must report)."""


class Touch:
    """Unpickling this creates ``path``: harmless but observable (``Path.touch`` through
    ``__reduce__``; no ``os.system``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (pathlib.Path.touch, (pathlib.PosixPath(self.path),))


def payload_bytes(real: bytes, marker_file: Path, where: Where = "top") -> bytes:
    """A pickle that creates ``marker_file`` when unpickled: the payload alone (``top``),
    or the real ``Metadata`` of ``real`` with the payload as one more value of its
    ``storage_data`` or ``planner_data`` (the refusal must come mid-stream, after the
    genuine classes)."""
    if where == "top":
        return pickle.dumps(Touch(marker_file))
    md = load_metadata(real, source="<real>")
    if where == "storage_data":
        md.storage_data[MetadataIndex("planted")] = Touch(marker_file)
    else:
        md.planner_data = {**(md.planner_data or {}), "planted": Touch(marker_file)}
    return pickle.dumps(md)


def plant_metadata_payload(ckpt_dir: Path, marker_file: Path, *, where: Where = "top",
                           member: str = layout.METADATA) -> None:
    """Replace ``ckpt_dir``'s ``member`` (``.metadata``, or a rank's ``__<r>.metadata``)
    with :func:`payload_bytes`, then rewrite ``manifest.json`` (the entry's size and CRC32C),
    its parts and ``COMPLETE`` (unsigned) so that the checkpoint verifies again on every
    path: only the restricted unpickler can stop it."""
    meta = ckpt_dir / member
    data = payload_bytes(meta.read_bytes(), marker_file, where)
    fs.write_durably(meta, data)
    m = mf.Manifest.from_bytes((ckpt_dir / layout.MANIFEST).read_bytes())
    crc = checksum.extend(0, data)
    files = tuple(dataclasses.replace(f, size=len(data), crc32c=crc, chunks=())
                  if f.name == member else f for f in m.files if not layout.is_part(f.name))
    sealed = seal(dataclasses.replace(m, files=files))
    for name, part in sealed.parts.items():
        fs.write_durably(ckpt_dir / name, part)
    fs.write_durably(ckpt_dir / layout.MANIFEST, sealed.manifest_bytes)
    (ckpt_dir / layout.COMPLETE).unlink()  # the marker is create-only
    fs.write_durably(ckpt_dir / layout.COMPLETE, sealed.marker_bytes, exclusive=True)
