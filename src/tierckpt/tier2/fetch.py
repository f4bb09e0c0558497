"""Bring a checkpoint from tier 2 back to a tier-1 root: verified, per file, committed.

:func:`remote_manifest` reads a tier-2 checkpoint's marker and manifest and verifies one
against the other (nothing else is trusted). :func:`fetch_into_tier1` then builds the
tier-1 directory the same way a save does — a fresh tmp directory, every file fsync'd,
manifest, rename, ``COMPLETE`` last — taking each needed file from the existing local copy
when it is present with the right size (and CRC32C when asked), and downloading only the
rest, several files in parallel, each verified against the manifest's CRC32C before it
appears under its name. A crash leaves only a tmp directory, removed at the next start.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierckpt.errors import IntegrityError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.tier1 import fs
from tierckpt.tier1.commit import commit_domain
from tierckpt.tier2.storage import Storage


def remote_manifest(storage: Storage, step: int) -> tuple[mf.Manifest, bytes, bytes]:
    """``(manifest, manifest_bytes, marker_bytes)`` of tier 2's checkpoint of ``step``,
    verified (marker digest and signature when a key is configured). Raises
    :class:`~tierckpt.errors.IntegrityError` or a ``StorageError``."""
    base = layout.step_dirname(step)
    marker = storage.get_bytes(f"{base}/{layout.COMPLETE}")
    mbytes = storage.get_bytes(f"{base}/{layout.MANIFEST}")
    m = mf.verify_marker(marker, mbytes, mf.signing_key())
    if m.step != step:
        raise IntegrityError(f"tier-2 {base} holds a manifest for step {m.step}")
    return m, mbytes, marker


def _local_ok(p: Path, f: mf.FileEntry, full: bool) -> bool:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    if not os.path.isfile(p) or os.path.islink(p) or st.st_size != f.size:
        return False
    return not full or checksum.of_file(p)[0] == f.crc32c


def fetch_into_tier1(storage: Storage, root: Path, step: int, *, names: Iterable[str] | None,
                     full: bool = False, parallel: int = 4, file_mode: int = 0o640,
                     dir_mode: int = 0o750) -> tuple[int, int]:
    """Make ``root/step-XXXXXXXX`` a committed checkpoint holding ``names`` (None: every
    file of the manifest). Returns ``(bytes_downloaded, bytes_reused_locally)``.

    An existing local directory for the step (complete or not) lends the files it has
    intact; it is replaced only after the new directory is fully written and verified.
    """
    m, mbytes, marker = remote_manifest(storage, step)
    wanted = [m.file(n) for n in names] if names is not None else list(m.files)
    final = root / layout.step_dirname(step)
    tmp = root / layout.tmp_dirname(step, f"fetch-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(mode=dir_mode)
    downloaded = reused = 0
    to_get: list[mf.FileEntry] = []
    for f in wanted:
        src = final / layout.safe_member_name(f.name)
        if final.is_dir() and _local_ok(src, f, full):
            os.link(src, tmp / f.name)
            reused += f.size
        else:
            to_get.append(f)

    def get(f: mf.FileEntry) -> int:
        storage.get_file(layout.object_key("", step, f.name), tmp / f.name, crc32c=f.crc32c)
        os.chmod(tmp / f.name, file_mode)
        return f.size

    with ThreadPoolExecutor(max(1, parallel), thread_name_prefix="tierckpt-fetch") as pool:
        downloaded = sum(pool.map(get, to_get))
    if final.exists() or final.is_symlink():
        fs.move_aside(final, root / layout.QUARANTINE, f"{final.name}.replaced-by-fetch")
    commit_domain(tmp, final, manifest_bytes=mbytes, marker_bytes=marker, metadata_bytes=None,
                  file_mode=file_mode)
    return downloaded, reused
