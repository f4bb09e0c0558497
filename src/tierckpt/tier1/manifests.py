"""Bounded, verified reads of a tier-1 checkpoint directory's marker and manifest.

Nothing of a checkpoint may be opened before :func:`read_committed` (or, for one domain or
one rank, :func:`read_domain` / :func:`read_part`) returns: each reads the ``COMPLETE``
marker and the manifest (or its parts) within :data:`SMALL_FILE_LIMIT` /
:data:`MANIFEST_LIMIT` bytes and checks them against each other (and the signature when a
key is set). They raise :class:`~tierckpt.errors.IntegrityError` for anything missing,
oversized or mismatched, :class:`~tierckpt.errors.SignatureError` for a bad signature, and
``OSError``. Pure reads: nothing here changes the directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.format.parts import assemble, has_header, part_entries, verify_part

_log = logging.getLogger("tierckpt")

SMALL_FILE_LIMIT = 64 << 20
"""Largest marker or small record any reader accepts (bytes); larger is an IntegrityError."""
MANIFEST_LIMIT = 1 << 30
"""Largest ``manifest.json`` any reader accepts (bytes). It lists every rank's files with a
CRC32C per record, so it grows with ranks × tensors: ~94 KiB per rank for a Llama-70B
state, 386 MiB at 4,096 ranks — past the 64 MiB small-file bound near 540 ranks, where a
restore refused the checkpoint it had just written (``bench --scale``). 1 GiB holds that
state up to ~11,000 ranks; a hostile file still cannot exhaust memory unbounded."""


def read_small(path: str | os.PathLike[str], limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The whole of a small file (a marker or manifest), refusing one over ``limit`` bytes
    with :class:`IntegrityError`: a damaged or hostile file must not exhaust memory."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise IntegrityError(f"{Path(path).name} is larger than {limit} bytes")
    return data


def _read_marker(ckpt_dir: Path) -> bytes:
    try:
        return read_small(ckpt_dir / layout.COMPLETE)
    except FileNotFoundError:
        raise IntegrityError("no COMPLETE marker (the save never committed)") from None


def read_committed(ckpt_dir: Path, *, step: int | None, rebuild: bool = True
                   ) -> mf.Committed:
    """The verified manifest of the checkpoint directory ``ckpt_dir``: marker and
    manifest read with :data:`SMALL_FILE_LIMIT` and :data:`MANIFEST_LIMIT`, the marker
    checked against the manifest (and its signature when a key is set) and, unless
    ``step`` is None, the manifest's step against the directory's. A ``manifest.json``
    that is missing or fails its marker is rebuilt from the manifest parts when they hold
    it exactly (:func:`rebuild_manifest`; logged): the same bytes the marker vouches for
    (``rebuild=False``: not, for a check that reports the damaged file). Raises
    :class:`IntegrityError` (no marker, no manifest, any mismatch) or ``OSError``. Nothing
    of the checkpoint may be opened before this returns."""
    marker = _read_marker(ckpt_dir)
    try:
        try:
            mbytes = read_small(ckpt_dir / layout.MANIFEST, MANIFEST_LIMIT)
        except FileNotFoundError:
            raise IntegrityError("COMPLETE present but manifest.json missing") from None
        return mf.verify_committed(marker, mbytes, step=step, name="directory")
    except SignatureError:
        raise
    except IntegrityError as e:
        rebuilt = rebuild_manifest(ckpt_dir, marker, step=step) if rebuild else None
        if rebuilt is None:
            raise
        _log.warning("%s: %s; rebuilt from its manifest parts, which its COMPLETE marker "
                     "vouches for", ckpt_dir, e)
        return rebuilt


def rebuild_manifest(ckpt_dir: Path, marker: bytes, *, step: int | None
                     ) -> mf.Committed | None:
    """The manifest of ``ckpt_dir`` assembled from its parts (:func:`~tierckpt.format.
    parts.assemble`) and verified against ``marker`` like ``manifest.json`` itself, or
    None when the parts cannot rebuild it (none, missing, damaged, or from before they
    carried the header). Reads every part: for the rare damaged manifest only."""
    names = mf.marker_parts(marker)
    if not names:
        return None
    try:
        parts = {n: read_small(ckpt_dir / n, MANIFEST_LIMIT) for n in names}
        return mf.verify_committed(marker, assemble(parts), step=step, name="directory")
    except SignatureError:
        raise
    except (IntegrityError, OSError):
        return None


def read_domain(ckpt_dir: Path, *, step: int | None, domain: tuple[int, ...],
                world_size: int) -> mf.Manifest | None:
    """What a domain restoring ``ckpt_dir`` on its saved layout needs of the manifest,
    from the parts alone: a manifest with the header (step, world size, domains, versions)
    that lists **only** the files of ``domain``'s ranks and the shared ones (the parts
    among them: only this domain's are read and checked). O(``domain``) reads, none of
    them O(W), each part verified against the marker (its digest, signed with a key).

    None when the marker vouches for no parts, the first part carries no header, or the
    job's layout is not the saved one (the caller reads the whole manifest). Raises
    :class:`IntegrityError` for a missing or damaged part (the caller may read the whole
    manifest instead), :class:`~tierckpt.errors.SignatureError` as :func:`read_committed`
    does, ``OSError``."""
    marker = _read_marker(ckpt_dir)
    names = mf.marker_parts(marker)
    if not names:
        return None
    key = mf.signing_key()

    read: dict[str, bytes] = {}

    def part(name: str) -> mf.Manifest:
        try:
            read[name] = read_small(ckpt_dir / name, MANIFEST_LIMIT)
        except FileNotFoundError:
            raise IntegrityError(f"COMPLETE names {name} but it is missing") from None
        return verify_part(marker, name, read[name], key)

    head = part(names[0])
    if not has_header(head) or head.world_size != world_size \
            or tuple(domain) not in head.domains:
        return None
    if step is not None and head.step != step:
        raise IntegrityError(f"directory is named for step {step} but its manifest is step "
                             f"{head.step} (renamed by hand?)")
    wanted, mine = set(domain), sorted({layout.part_filename(r) for r in domain})
    files: dict[str, mf.FileEntry] = {}
    for name in mine:
        for f in (head if name == names[0] else part(name)).files:
            if f.rank is None or f.rank in wanted:
                files[f.name] = f
    # this domain's parts, as the whole manifest lists them (from the bytes just verified)
    files.update((f.name, f) for f in part_entries({n: read[n] for n in mine}))
    return dataclasses.replace(head, files=tuple(files.values()))


def read_part(ckpt_dir: Path, rank: int) -> mf.Manifest | None:
    """``rank``'s manifest part of the checkpoint directory ``ckpt_dir``, verified against
    its marker (:func:`tierckpt.format.parts.verify_part`: it lists only that rank's
    group's files and the shared ones), or None when the marker vouches for no parts (a
    checkpoint from before them). Raises :class:`IntegrityError` (no marker, a missing or
    damaged part: the caller reads the whole manifest instead) or ``OSError``."""
    marker = _read_marker(ckpt_dir)
    if not mf.marker_parts(marker):
        return None
    name = layout.part_filename(rank)
    try:
        data = read_small(ckpt_dir / name, MANIFEST_LIMIT)
    except FileNotFoundError:
        raise IntegrityError(f"COMPLETE names {name} but it is missing") from None
    return verify_part(marker, name, data, mf.signing_key(), rank=rank)
