"""Tier 0 keeps its RAM: shard files of a dropped step are rewritten, not freed and refilled.

Writing into a tmpfs file costs what the kernel pays to hand out its pages (zeroing and
mapping them: ~3× a memcpy per byte here), unless the pages are already the file's. So when
retention drops this node's oldest tier-0 step, its shard files (``__<rank>_<i>.distcp``)
move into ``<tier0>/free/`` instead of being deleted, and the next save of each rank renames
its own files of the same names into the save's directory and overwrites them in place
(:class:`~tierckpt.tier1.directio.DirectFile` with ``reuse=True``: written from offset 0,
truncated to the new length). A save that finds none (the first ones, a new layout) writes
fresh files as before; :func:`reserve` lets a rank give its next save pages up front.

Contract: a file is taken only while its link count is 1 — no committed step, replica or
tier-1 copy (a hard link on the same file system) shares its inode — so rewriting it can
change no checkpoint. ``free/`` holds one set at a time (retiring a step first empties it),
so tier 0 keeps ``keep`` committed steps plus one set, inside the ``keep + 1`` its RAM budget
already reserves. A file taken and then abandoned by a crash is a tmp directory's debris,
removed at start-up like any other.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tierckpt.format import layout
from tierckpt.tier1 import fs
from tierckpt.tier1.catalog import Tier1Catalog


def retire(catalog: Tier1Catalog, step: int, free: Path) -> None:
    """Drop the committed ``step`` (unpublished first, so it is never chosen half-gone) and
    keep its shard files in ``free`` for the next save's writers, replacing what was
    there. Anything else of the step is deleted."""
    gone = catalog.unpublish(step)
    clear(free)
    with contextlib.suppress(FileNotFoundError):
        free.mkdir(exist_ok=True)
        for entry in os.scandir(gone):
            if layout.shard_rank(entry.name) is not None \
                    and entry.is_file(follow_symlinks=False) \
                    and entry.stat(follow_symlinks=False).st_nlink == 1:
                os.rename(entry.path, free / entry.name)
    fs.remove_tree(gone)


def clear(free: Path) -> None:
    """Release the pages ``free`` holds (its files are deleted; the directory stays)."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(free):
            with contextlib.suppress(FileNotFoundError):
                fs.remove_tree(entry.path)


def take(free: Path, name: str, dest: Path) -> bool:
    """Move the free file ``name`` to ``dest`` (a new save's file); True when ``dest`` is now
    a file with pages to overwrite, False when there was none (``dest`` does not exist)."""
    try:
        os.rename(free / layout.safe_member_name(name), dest)
    except (FileNotFoundError, NotADirectoryError):
        return False
    st = os.lstat(dest)
    if st.st_nlink == 1 and not os.path.islink(dest):
        return True
    os.unlink(dest)  # shared with something else: never rewrite it
    return False


def reserve(free: Path, sizes: dict[str, int], *, file_mode: int) -> int:
    """Give ``free`` files of these names and sizes whose pages are allocated (a rank's own
    shard files, after its first tier-0 save), so the next save into RAM overwrites instead
    of allocating. Names already there are left alone. Returns the bytes allocated; a full
    tmpfs ends it early (the next save then allocates as it writes, and fails as usual)."""
    done = 0
    for name, size in sizes.items():
        path = free / layout.safe_member_name(name)
        if path.exists():
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, file_mode)
        except (FileExistsError, FileNotFoundError):
            continue
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
            done += size
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            break
        finally:
            os.close(fd)
    return done
