"""The manifest value, its canonical JSON form, and the COMPLETE marker body. Pure: no I/O.

The manifest lists every file of a checkpoint with its size and CRC32C (computed while the
file was written), plus the step, world size, save id, the tier-1 domains (groups of ranks
that share one tier-1 root, e.g. one node) and versions. ``COMPLETE`` holds the SHA-256 of
the manifest's exact bytes, so a marker vouches for one manifest and nothing else.

Optional signing: with a key (``TIERCKPT_SIGNING_KEY``), the marker also carries an
HMAC-SHA256 of the manifest bytes; :func:`verify_marker` refuses unsigned or badly signed
markers when a key is configured.

Parts (:mod:`tierckpt.format.parts`): beside the manifest, each group of ranks has a part
that lists their entries, and the marker holds each part's SHA-256 (:func:`marker_bytes`
with ``parts``; signed with a key), so a rank verifies its own part instead of the whole
manifest. The marker holds its own digest too (``marker_sha256``): a reader that checks
parts against an intact marker knows the manifest digest in it is the sealer's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import checksum
from tierckpt.format.layout import safe_member_name

FORMAT_VERSION = 1
SIGNING_KEY_ENV = "TIERCKPT_SIGNING_KEY"


class Chunk(NamedTuple):
    """One stored record of a shard file (a DCP item: one tensor chunk or bytes blob):
    its byte range and the CRC32C of exactly those bytes, so a reader that fetches only
    this range can verify it without the rest of the file."""

    offset: int
    length: int
    crc32c: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint. ``rank`` is the writer (None for files the coordinator
    writes, such as ``.metadata``, which every tier-1 domain holds a copy of).

    ``chunks`` lists the file's records in offset order (written by tierckpt since the
    ranged reader; empty in older manifests, whose files can only be verified whole)."""

    name: str
    size: int
    crc32c: int
    rank: int | None = None
    chunks: tuple[Chunk, ...] = ()

    def chunk(self, offset: int, length: int) -> Chunk | None:
        """The recorded chunk with exactly this range, or None."""
        for c in self.chunks:
            if c.offset == offset and c.length == length:
                return c
        return None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "size": self.size,
                             "crc32c": checksum.to_hex(self.crc32c), "rank": self.rank}
        if self.chunks:  # absent, not empty, so older manifests keep their exact bytes
            d["chunks"] = [[c.offset, c.length, checksum.to_hex(c.crc32c)]
                           for c in self.chunks]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FileEntry:
        size, rank = d["size"], d.get("rank")
        if not isinstance(size, int) or size < 0:
            raise IntegrityError(f"manifest file size must be a non-negative int, got {size!r}")
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise IntegrityError(f"manifest file rank must be a non-negative int, got {rank!r}")
        return cls(name=safe_member_name(str(d["name"])), size=size,
                   crc32c=checksum.from_hex(str(d["crc32c"])), rank=rank,
                   chunks=_chunks_from_json(d.get("chunks", ()), size))


def _chunks_from_json(raw: Any, size: int) -> tuple[Chunk, ...]:
    """Parse a file entry's ``chunks``: in order, non-overlapping, inside the file."""
    if not isinstance(raw, list | tuple):
        raise IntegrityError(f"manifest chunks must be a list, got {type(raw).__name__}")
    out, end = [], 0
    for c in raw:
        if not (isinstance(c, list) and len(c) == 3 and all(isinstance(v, int) for v in c[:2])
                and c[0] >= end and c[1] >= 0 and c[0] + c[1] <= size):
            raise IntegrityError(f"manifest chunk {c!r} is malformed, overlaps the previous "
                                 f"one or lies outside the file ({size} bytes)")
        out.append(Chunk(c[0], c[1], checksum.from_hex(str(c[2]))))
        end = c[0] + c[1]
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a committed checkpoint contains. Immutable; ``to_bytes`` is canonical."""

    step: int
    world_size: int
    save_id: str
    files: tuple[FileEntry, ...]
    domains: tuple[tuple[int, ...], ...] = ()
    created_unix: float = 0.0
    torch_version: str = ""
    tierckpt_version: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        # canonical order, so equal manifests compare equal and serialise identically
        object.__setattr__(self, "files", tuple(sorted(self.files, key=lambda f: f.name)))

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @functools.cached_property
    def _by_name(self) -> dict[str, FileEntry]:
        return {f.name: f for f in self.files}

    def file(self, name: str) -> FileEntry:
        """The entry of file ``name`` (KeyError when none): O(1)."""
        return self._by_name[name]

    def files_for_ranks(self, ranks: Iterable[int]) -> tuple[FileEntry, ...]:
        """Files a tier-1 domain holding ``ranks`` must have: theirs plus shared ones."""
        wanted = set(ranks)
        return tuple(f for f in self.files if f.rank is None or f.rank in wanted)

    def to_bytes(self) -> bytes:
        body = {
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "save_id": self.save_id,
            "created_unix": self.created_unix,
            "torch_version": self.torch_version,
            "tierckpt_version": self.tierckpt_version,
            "domains": [list(d) for d in self.domains],
            "files": [f.to_json() for f in self.files],
        }
        # compact: the manifest lists a few files per rank, read whole by every restoring
        # rank (manifests written with indentation before parse the same)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse and validate; any malformation is an :class:`IntegrityError`."""
        try:
            d = json.loads(data.decode("utf-8"))
            if not isinstance(d, dict):
                raise TypeError("manifest is not a JSON object")
            if d.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"unsupported manifest format {d.get('format_version')!r}")
            files = tuple(FileEntry.from_json(f) for f in d["files"])
            names = [f.name for f in files]
            if len(set(names)) != len(names):
                raise ValueError("duplicate file names")
            m = cls(
                step=int(d["step"]), world_size=int(d["world_size"]), save_id=str(d["save_id"]),
                files=files, domains=tuple(tuple(int(r) for r in g) for g in d["domains"]),
                created_unix=float(d["created_unix"]), torch_version=str(d["torch_version"]),
                tierckpt_version=str(d["tierckpt_version"]),
            )
        except IntegrityError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise IntegrityError(f"malformed manifest: {e}") from e
        if m.step < 0 or m.world_size < 1:
            raise IntegrityError(f"manifest has step={m.step} world_size={m.world_size}")
        return m


def canonical(body: Mapping[str, Any]) -> bytes:
    """The canonical JSON bytes of ``body`` (sorted keys, compact, one trailing newline):
    equal bodies give equal bytes, so their digests can be compared."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n"


def _parts_map(parts: Mapping[str, bytes]) -> dict[str, str]:
    return {n: hashlib.sha256(b).hexdigest() for n, b in sorted(parts.items())}


def digest(manifest_bytes: bytes) -> str:
    """SHA-256 hex digest of the exact manifest bytes (what COMPLETE vouches for)."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def signing_key() -> bytes | None:
    """The configured signing key (from ``TIERCKPT_SIGNING_KEY``), or None."""
    key = os.environ.get(SIGNING_KEY_ENV)
    return key.encode("utf-8") if key else None


def marker_bytes(manifest_bytes: bytes, step: int, save_id: str,
                 key: bytes | None = None, parts: Mapping[str, bytes] | None = None) -> bytes:
    """Body of the ``COMPLETE`` marker for this manifest (signed when ``key`` is given),
    with the SHA-256 of each of its ``parts`` (:func:`tierckpt.format.parts.parts_of`) when
    given."""
    body: dict[str, Any] = {"step": step, "save_id": save_id,
                            "manifest_sha256": digest(manifest_bytes)}
    if key is not None:
        body["manifest_hmac_sha256"] = hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()
    if parts:
        body["parts_sha256"] = _parts_map(parts)
        if key is not None:
            body["parts_hmac_sha256"] = hmac.new(key, canonical(body["parts_sha256"]),
                                                 hashlib.sha256).hexdigest()
        # the marker's own digest: a reader that checks parts against it, not the manifest,
        # still knows the manifest digest is the sealer's (so the parts rebuild that manifest)
        body["marker_sha256"] = hashlib.sha256(canonical(body)).hexdigest()
    return json.dumps(body, sort_keys=True).encode("utf-8") + b"\n"


def marker_body(marker: bytes) -> dict[str, Any]:
    """The parsed marker, its own digest checked when it has one (markers with parts);
    :class:`IntegrityError` when it is malformed or its own digest does not match."""
    try:
        body = json.loads(marker.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise IntegrityError(f"malformed COMPLETE marker: {e}") from e
    if not isinstance(body, dict):
        raise IntegrityError("malformed COMPLETE marker: not a JSON object")
    own = body.pop("marker_sha256", None)
    if own is not None and not hmac.compare_digest(
            str(own), hashlib.sha256(canonical(body)).hexdigest()):
        raise IntegrityError("COMPLETE marker is damaged: its own digest does not match it")
    return body


def marker_parts(marker: bytes) -> tuple[str, ...]:
    """The parts ``marker`` vouches for, by name in order (none before parts existed)."""
    digests = marker_body(marker).get("parts_sha256")
    return tuple(sorted(str(n) for n in digests)) if isinstance(digests, dict) else ()


def verify_marker(marker: bytes, manifest_bytes: bytes, key: bytes | None = None) -> Manifest:
    """Check that ``marker`` vouches for ``manifest_bytes`` and return the parsed manifest.

    Raises :class:`IntegrityError` when the digest, step or save id disagree, and
    :class:`SignatureError` when ``key`` is set and the HMAC is missing or wrong. Only after
    this returns may anything named in the manifest (including DCP's pickled ``.metadata``)
    be opened.
    """
    body = marker_body(marker)
    try:
        want = str(body["manifest_sha256"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"malformed COMPLETE marker: {e}") from e
    if not hmac.compare_digest(want, digest(manifest_bytes)):
        raise IntegrityError("COMPLETE marker digest does not match manifest.json")
    if key is not None:
        sig = body.get("manifest_hmac_sha256")
        if not isinstance(sig, str):
            raise SignatureError(
                f"checkpoint is unsigned but {SIGNING_KEY_ENV} is set; refusing to load it")
        good = hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig, good):
            raise SignatureError("manifest signature does not verify with the configured key")
    m = Manifest.from_bytes(manifest_bytes)
    if body.get("step") != m.step or body.get("save_id") != m.save_id:
        raise IntegrityError("COMPLETE marker step/save_id disagree with manifest.json")
    return m


class Committed(NamedTuple):
    """A checkpoint's manifest with the exact bytes its marker vouches for (both verified)."""

    manifest: Manifest
    manifest_bytes: bytes
    marker_bytes: bytes


def verify_committed(marker: bytes, manifest_bytes: bytes, *, step: int | None,
                     name: str) -> Committed:
    """:func:`verify_marker` with the configured signing key, plus the check that the
    checkpoint called ``name`` on its tier really is ``step`` (not one renamed by hand;
    None: not checked). Every tier's catalogue reads a committed checkpoint through this."""
    m = verify_marker(marker, manifest_bytes, signing_key())
    if step is not None and m.step != step:
        raise IntegrityError(f"{name} is named for step {step} but its manifest is step "
                             f"{m.step} (renamed by hand?)")
    return Committed(m, manifest_bytes, marker)
