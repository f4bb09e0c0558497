"""The manifest parts: the manifest cut per group of ranks, so a rank reads O(1) entries.

Each group of :data:`~tierckpt.format.layout.PART_RANKS` ranks has a part (:func:`parts_of`:
their entries and the shared files'), listed in the manifest like any file; the COMPLETE
marker holds each part's SHA-256 (signed with a key), so :func:`verify_part` checks one part
against the marker alone. The first part also carries the manifest's header, so the parts
alone rebuild the manifest byte for byte (:func:`assemble`). :func:`seal` makes what a commit
writes: the manifest with its parts listed, its bytes, its marker and the parts. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import checksum
from tierckpt.format.layout import PART_RANKS, is_part, part_filename, part_number
from tierckpt.format.manifest import (
    FORMAT_VERSION,
    SIGNING_KEY_ENV,
    FileEntry,
    Manifest,
    canonical,
    marker_body,
    marker_bytes,
)


def _header(m: Manifest) -> dict[str, Any]:
    """What a manifest holds besides its files and the step, save id and world size."""
    return {"created_unix": m.created_unix, "domains": [list(d) for d in m.domains],
            "tierckpt_version": m.tierckpt_version, "torch_version": m.torch_version}


def parts_of(m: Manifest) -> dict[str, bytes]:
    """The canonical bytes of each part of ``m`` (its files, without parts), by file name:
    part k lists the files of ranks ``PART_RANKS`` × k … × k + ``PART_RANKS`` − 1 and every
    shared file (rank None: ``.metadata``), so a rank finds in its part every file a restore
    on the saved layout may read. The first part also carries the manifest's header
    (domains, creation time, versions): the parts alone rebuild the manifest
    (:func:`assemble`). Deterministic."""
    files = sorted(m.files, key=lambda f: f.name)
    shared = [f for f in files if f.rank is None]
    by_part: dict[str, list[FileEntry]] = {}
    for f in files:
        if f.rank is not None:
            by_part.setdefault(part_filename(f.rank), []).append(f)
    out = {}
    for i, (name, own) in enumerate(sorted(by_part.items())):
        body: dict[str, Any] = {
            "format_version": m.format_version, "step": m.step, "save_id": m.save_id,
            "world_size": m.world_size, "part": name,
            "files": [f.to_json() for f in sorted([*own, *shared], key=lambda f: f.name)]}
        if i == 0:
            body["header"] = _header(m)
        out[name] = canonical(body)
    return out


def part_entries(parts: Mapping[str, bytes]) -> list[FileEntry]:
    """The manifest's entries of ``parts`` (shared files: every domain holds them)."""
    return [FileEntry(name=n, size=len(b), crc32c=checksum.extend(0, b), rank=None)
            for n, b in sorted(parts.items())]


class Sealed(NamedTuple):
    """A manifest ready to commit: its parts listed in it, its bytes, the marker vouching
    for both, and the parts' bytes by name."""

    manifest: Manifest
    manifest_bytes: bytes
    marker_bytes: bytes
    parts: dict[str, bytes]


def seal(m: Manifest, key: bytes | None = None) -> Sealed:
    """``m`` (its files, without parts) with its parts (:func:`parts_of`) listed, its
    canonical bytes and its marker (signed when ``key`` is given): what a commit writes."""
    parts = parts_of(m)
    full = dataclasses.replace(m, files=(*m.files, *part_entries(parts)))
    data = full.to_bytes()
    return Sealed(full, data, marker_bytes(data, m.step, m.save_id, key, parts), parts)


def rebuild_parts(m: Manifest) -> dict[str, bytes]:
    """The parts of a sealed manifest, rebuilt from its other entries (the sealer's bytes
    exactly: parts are a function of the entries); raises :class:`IntegrityError` when they
    differ from the part entries ``m`` lists."""
    listed = sorted((f for f in m.files if is_part(f.name)), key=lambda f: f.name)
    names = {f.name for f in listed}
    parts = parts_of(dataclasses.replace(
        m, files=tuple(f for f in m.files if f.name not in names)))
    if part_entries(parts) != listed:
        raise IntegrityError(f"step {m.step}: the manifest parts rebuilt from its entries "
                             "differ from the ones it lists")
    return parts


def verify_part(marker: bytes, name: str, data: bytes, key: bytes | None = None,
                *, rank: int | None = None) -> Manifest:
    """Check that ``marker`` vouches for part ``name`` (``data``; the part of ``rank`` when
    given) and return it as a manifest that lists **only** the part's files: its group's
    and the shared ones, with the manifest's header (domains, versions) when it is the
    first part. Enough for reads of the part's ranks on the saved layout, nothing else.
    Raises :class:`IntegrityError` (digest, step, save id or ranks disagree) or
    :class:`SignatureError` as :func:`verify_marker` does."""
    body = marker_body(marker)
    try:
        digests = body["parts_sha256"]
        want = str(digests[name])
        step, save_id = int(body["step"]), str(body["save_id"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"COMPLETE marker does not vouch for {name}: {e}") from e
    k = part_number(name)
    if k is None or (rank is not None and name != part_filename(rank)):
        raise IntegrityError(f"{name} is not the manifest part of rank {rank}")
    if not hmac.compare_digest(want, hashlib.sha256(data).hexdigest()):
        raise IntegrityError(f"COMPLETE marker digest does not match {name}")
    if key is not None:
        sig = body.get("parts_hmac_sha256")
        good = hmac.new(key, canonical(digests), hashlib.sha256).hexdigest()
        if not isinstance(sig, str):
            raise SignatureError(
                f"checkpoint is unsigned but {SIGNING_KEY_ENV} is set; refusing to load it")
        if not hmac.compare_digest(sig, good):
            raise SignatureError("manifest part signature does not verify with the "
                                 "configured key")
    m = parse_part(name, data)
    lo = k * PART_RANKS
    if m.step != step or m.save_id != save_id or not all(
            f.rank is None or lo <= f.rank < lo + PART_RANKS for f in m.files):
        raise IntegrityError(f"{name} disagrees with its COMPLETE marker (step, save id or "
                             "ranks)")
    return m


def parse_part(name: str, data: bytes) -> Manifest:
    """Part ``name`` as a manifest of its files (and the header, in the first part);
    unverified: :class:`IntegrityError` only when it is malformed. Check it against its
    marker with :func:`verify_part`."""
    try:
        d = json.loads(data.decode("utf-8"))
        if d.get("format_version") != FORMAT_VERSION or d.get("part") != name:
            raise ValueError(f"not the part {name} of format {FORMAT_VERSION}")
        h = d.get("header") or {}
        return Manifest(step=int(d["step"]), world_size=int(d["world_size"]),
                        save_id=str(d["save_id"]),
                        files=tuple(FileEntry.from_json(f) for f in d["files"]),
                        domains=tuple(tuple(int(r) for r in g) for g in h.get("domains", ())),
                        created_unix=float(h.get("created_unix", 0.0)),
                        torch_version=str(h.get("torch_version", "")),
                        tierckpt_version=str(h.get("tierckpt_version", "")))
    except IntegrityError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"malformed {name}: {e}") from e


def has_header(part: Manifest) -> bool:
    """Whether a part (:func:`verify_part`) carries the manifest's header: the first
    part of a checkpoint saved since parts carry it (every saved layout has a domain)."""
    return bool(part.domains)


def assemble(parts: Mapping[str, bytes]) -> bytes:
    """The manifest's canonical bytes rebuilt from all of its ``parts`` alone (the first
    carries the header): the inverse of :func:`seal`, for a ``manifest.json`` that is
    lost or damaged. Nothing here is trusted: check the result against the marker
    (:func:`verify_marker`), whose digest covers every entry, the parts' included. Raises
    :class:`IntegrityError` when the parts are malformed, carry no header or disagree."""
    if not parts:
        raise IntegrityError("no manifest parts to rebuild manifest.json from")
    names = sorted(parts)
    head = parse_part(names[0], parts[names[0]])
    if not has_header(head):
        raise IntegrityError(f"{names[0]} carries no manifest header (saved before parts did)")
    files: dict[str, FileEntry] = {}
    for name in names:
        p = head if name == names[0] else parse_part(name, parts[name])
        if (p.step, p.save_id, p.world_size) != (head.step, head.save_id, head.world_size):
            raise IntegrityError(f"{name} is of another checkpoint than {names[0]}")
        for f in p.files:
            if files.setdefault(f.name, f) != f:
                raise IntegrityError(f"{name} and another part disagree about {f.name}")
    return dataclasses.replace(
        head, files=(*files.values(), *part_entries(parts))).to_bytes()
