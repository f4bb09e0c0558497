"""Verify one tier-1 checkpoint before anything in it is opened. Torch-free.

Marker and manifest first (bounded reads through :mod:`tierckpt.tier1.catalog`; on the
saved layout only the marker and this domain's manifest parts, whatever the world size),
then every file this domain needs: present, a regular file, of the manifest's size — and its
CRC32C when asked. DCP's pickled ``.metadata`` is CRC-checked here unless the restore will
plan from each rank's own ``__<rank>.metadata`` (the saved layout): the reader checks
whichever metadata file it opens against the manifest before unpickling it, so a same-size
substitute is never unpickled either way.
"""

from __future__ import annotations

import enum
import os
import stat
from pathlib import Path

from tierckpt.errors import IntegrityError, MissingFilesError, SignatureError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.tier1.catalog import read_committed, read_domain


class Verify(str, enum.Enum):
    """How much of a checkpoint is checked before it is restored: one vocabulary for
    ``ManagerConfig.verify`` and the integrations (``verify="full"`` is accepted too).

    ``SIZES``: the marker's digest, the manifest, and every file's size (cheap; the
    default). ``FULL``: also every file's CRC32C (reads every byte once more).
    """

    SIZES = "sizes"
    FULL = "full"


def required_ranks(m: mf.Manifest, domain: tuple[int, ...] | None,
                   world_size: int | None) -> set[int] | None:
    """Ranks whose files a domain must hold to restore ``m``: its own ranks when the job
    has the saved layout (same world size and this domain was a saved domain), else every
    rank (None), since a reshard may read any shard."""
    if domain is None or world_size != m.world_size or tuple(domain) not in m.domains:
        return None
    return set(domain)


def verify_checkpoint(ckpt_dir: Path, *, step: int | None = None,
                      domain: tuple[int, ...] | None = None, world_size: int | None = None,
                      full: bool = False) -> mf.Manifest:
    """Verify one tier-1 checkpoint directory; return its manifest (on the saved layout,
    one that lists only this domain's files and the shared ones) or raise
    :class:`IntegrityError` with the reason (:class:`MissingFilesError` when the only
    problem is files this domain needs but does not hold; see :func:`required_ranks`).
    ``step`` (when given) must be the manifest's; ``full`` checks every file's CRC32C."""
    st = os.lstat(ckpt_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise IntegrityError(f"{ckpt_dir.name} is not a directory (symlink or file)")
    m = _read_manifest(ckpt_dir, step, domain, world_size)
    ranks = required_ranks(m, domain, world_size)
    wanted = m.files if ranks is None else m.files_for_ranks(ranks)
    # the global pickle is CRC-checked here unless each rank of this domain restores from
    # its own __<rank>.metadata (checked when read, as .metadata is if a rank falls back)
    names = {f.name for f in wanted}
    global_crc = ranks is None or not all(
        layout.rank_metadata_filename(r) in names for r in ranks)
    missing = []
    for f in wanted:
        p = ckpt_dir / layout.safe_member_name(f.name)
        try:
            fst = os.lstat(p)
        except FileNotFoundError:
            missing.append(f.name)
            continue
        if not stat.S_ISREG(fst.st_mode):
            raise IntegrityError(f"{f.name} is not a regular file")
        if fst.st_size != f.size:
            raise IntegrityError(f"{f.name} has {fst.st_size} bytes, manifest says {f.size}")
        if full or (f.name == layout.METADATA and global_crc):
            crc, _ = checksum.of_file(p)
            if crc != f.crc32c:
                raise IntegrityError(f"{f.name} CRC32C {checksum.to_hex(crc)} != manifest "
                                     f"{checksum.to_hex(f.crc32c)}")
    if missing:
        _raise_missing(ckpt_dir, m, missing)
    return m


def _read_manifest(ckpt_dir: Path, step: int | None, domain: tuple[int, ...] | None,
                   world_size: int | None) -> mf.Manifest:
    """On the saved layout, the domain's view from the manifest parts (O(domain): see
    :func:`~tierckpt.tier1.catalog.read_domain`); else, or when a part is damaged, the
    whole manifest. A damaged ``manifest.json`` beside intact parts loses nothing: every
    reader of the whole manifest rebuilds it from them (:func:`read_committed`)."""
    if domain is not None and world_size is not None:
        try:
            view = read_domain(ckpt_dir, step=step, domain=domain, world_size=world_size)
            if view is not None:
                return view
        except SignatureError:
            raise
        except IntegrityError:
            pass  # a damaged part: the whole manifest decides (the loader notes the part)
    return read_committed(ckpt_dir, step=step).manifest


def _raise_missing(ckpt_dir: Path, m: mf.Manifest, missing: list[str]) -> None:
    """A file of this directory's own saved domain (the domain whose ranks' files are here)
    or a shared file is damage; only other domains' files are fetchable absences."""
    present = {f.rank for f in m.files
               if f.rank is not None and os.path.lexists(ckpt_dir / f.name)}
    home = {r for d in m.domains if set(d) & present for r in d} if len(m.domains) > 1 \
        else set(range(m.world_size))
    own = [f.name for f in m.files if f.name in missing and (f.rank is None or f.rank in home)]
    names = own or missing
    text = (f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
            f"{'is' if len(names) == 1 else 'are'} missing")
    if own:
        raise IntegrityError(text)
    raise MissingFilesError(text + " (held by another node's tier 1)", missing)
