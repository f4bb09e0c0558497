"""The only code that turns written files into a committed checkpoint (tier 1).

Protocol, per tier-1 domain (a set of ranks sharing one tier-1 root), run by the domain's
owner after every rank's files are written and fsync'd and the coordinator has built the
manifest:

1. ``.metadata`` is written into the tmp directory if this domain does not have it yet
   (domains other than the coordinator's receive the coordinator's exact bytes), and the
   manifest's parts (``manifest.<k>.json``) beside it;
2. ``manifest.json`` is written and fsync'd, then the tmp directory is fsync'd;
3. the tmp directory is renamed to ``step-XXXXXXXX`` (never over an existing one) and the
   parent is fsync'd;
4. ``COMPLETE`` (the manifest digest) is created exclusively and fsync'd, parent fsync'd.

A crash before step 4 leaves no ``COMPLETE``: the directory does not count, and start-up
cleanup removes tmp directories. Nothing here ever touches another committed checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tierckpt.errors import CheckpointError
from tierckpt.format import layout
from tierckpt.tier1 import fs


def commit_domain(tmp_dir: Path, final_dir: Path, *, manifest_bytes: bytes, marker_bytes: bytes,
                  metadata_bytes: bytes | None, file_mode: int = fs.DEFAULT_FILE_MODE,
                  parts: Mapping[str, bytes] | None = None) -> None:
    """Run steps 1–4 above for one domain. Raises ``CheckpointError`` if ``final_dir``
    already exists (a step is committed once) or OSError from the file system."""
    if final_dir.exists():
        raise CheckpointError(f"{final_dir} already exists; refusing to overwrite a checkpoint")
    meta = tmp_dir / layout.METADATA
    if metadata_bytes is not None and not meta.exists():
        fs.write_durably(meta, metadata_bytes, mode=file_mode)
    for name, data in (parts or {}).items():
        fs.write_durably(tmp_dir / layout.safe_member_name(name), data, mode=file_mode)
    fs.write_durably(tmp_dir / layout.MANIFEST, manifest_bytes, mode=file_mode)
    fs.fsync_dir(tmp_dir)
    os.rename(tmp_dir, final_dir)
    fs.fsync_dir(final_dir.parent)
    fs.write_durably(final_dir / layout.COMPLETE, marker_bytes, mode=file_mode, exclusive=True)

