"""Bring a checkpoint from tier 2 back to a tier-1 root: verified, per file, committed.

:func:`fetch_into_tier1` reads a tier-2 checkpoint's marker and manifest and verifies one
against the other through the tier-2 catalogue (nothing else is trusted), finds each file
through the step's object map when it has one (content-addressed tier 2, the map checked
against the manifest: :meth:`~tierckpt.tier2.catalog.Tier2Catalog.resolve`), then builds the
tier-1 directory the same way a save does — a fresh tmp directory, every file fsync'd,
manifest, rename, ``COMPLETE`` last — taking each needed file from the existing local copy
when it is present with the right size (and CRC32C when asked), and downloading only the
rest, several files in parallel, each verified against the manifest's CRC32C before it
appears under its name. A failed download removes its tmp directory; a crash leaves only
that directory, removed at the next start.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.commit import commit_domain
from tierckpt.tier1.fs import remove_tree
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage.base import Progress, ProgressTally


def _local_ok(p: Path, f: mf.FileEntry, full: bool) -> bool:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    if not os.path.isfile(p) or os.path.islink(p) or st.st_size != f.size:
        return False
    return not full or checksum.of_file(p)[0] == f.crc32c


def fetch_into_tier1(remote: Tier2Catalog, local: Tier1Catalog, step: int, *,
                     names: Iterable[str] | None,
                     full: bool = False, parallel: int = 4, file_mode: int = 0o640,
                     dir_mode: int = 0o750,
                     progress: Progress | None = None) -> tuple[int, int]:
    """Make ``local``'s ``step-XXXXXXXX`` a committed checkpoint holding ``names`` (None:
    every file of the manifest). Returns ``(bytes_downloaded, bytes_reused_locally)``;
    ``progress`` hears the bytes in place (reused, then downloaded) after each file.

    An existing local directory for the step (complete or not) lends the files it has
    intact; it is replaced (moved to quarantine) only after the new directory is fully
    written and verified.
    """
    where = remote.resolve(step)
    m, mbytes, marker = where.committed
    root = local.root
    wanted = [m.file(n) for n in names] if names is not None else list(m.files)
    final = local.step_dir(step)
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

    tally = ProgressTally(sum(f.size for f in wanted), progress)
    tally.add(reused)

    def get(f: mf.FileEntry) -> int:
        remote.storage.get_file(where.key(f.name), tmp / f.name, crc32c=f.crc32c)
        os.chmod(tmp / f.name, file_mode)
        tally.add(f.size)
        return f.size

    try:
        with ThreadPoolExecutor(max(1, parallel), thread_name_prefix="tierckpt-fetch") as pool:
            downloaded = sum(pool.map(get, to_get))
    except BaseException:
        with contextlib.suppress(OSError):  # a failed fetch leaves nothing on tier 1
            remove_tree(tmp)
        raise
    if final.exists() or final.is_symlink():
        local.quarantine(step, "replaced by a fetch from tier 2", suffix=".replaced-by-fetch")
    commit_domain(tmp, final, manifest_bytes=mbytes, marker_bytes=marker, metadata_bytes=None,
                  file_mode=file_mode)
    return downloaded, reused
