"""Content-addressed tier 2: object keys and a step's object map. Pure: no I/O.

On tier 2 (layout 2) the bytes of a checkpoint's files live once, under
``objects/sha256/<hex>`` (the SHA-256 of exactly those bytes), however many steps contain
them; a step keeps only its small files under ``step-XXXXXXXX/``: ``objects.json`` (the
*map*, :class:`ObjectMap`: member → object key, size, CRC32C, SHA-256), ``manifest.json``
and ``COMPLETE`` (written last, exactly the tier-1 marker). Layout 1 — every member under
the step prefix — is what tierckpt wrote before; a step without a map is read that way.

Why the map is trusted, though ``COMPLETE`` covers only the manifest (which must stay the
tier-1 manifest, byte for byte, so the marker is the same on every tier, ``dcp.load`` and
tier-1 verification are unchanged and a fetched step is an ordinary tier-1 checkpoint):

- the map names the manifest it belongs to (``manifest_sha256``) and lists exactly the
  manifest's files with the manifest's sizes and CRC32Cs (:meth:`ObjectMap.check`), so it
  cannot be spliced from another step, and every byte read through it is checked against
  the manifest's CRC32C, which the marker does cover;
- it holds its own SHA-256 (``map_sha256``) and, when a signing key is configured, an
  HMAC-SHA256 (``map_hmac_sha256``), refused when missing — the same rule as the marker;
- an object's key is the SHA-256 of its bytes, so a full read can check the address too.

Intents: each uploader writes its own *part* of the map (``objects.<tag>.json``, the same
form, its own files only) before it decides to skip an object that is already there; a
part protects its objects from deletion until the step's marker lands and the committing
uploader has merged the parts into ``objects.json`` (:mod:`tierckpt.tier2.sweep`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tierckpt.errors import IntegrityError, SignatureError
from tierckpt.format import checksum
from tierckpt.format import manifest as mf
from tierckpt.format.layout import safe_member_name

MAP_VERSION = 1
"""Version of ``objects.json`` (and its parts); readers refuse any other."""
MAP = "objects.json"
"""The step's merged map, written before ``manifest.json`` and ``COMPLETE``."""
OBJECTS = "objects/sha256/"
"""Prefix (below the store's) of the content objects."""
SWEEPS = "objects/sweeps/"
"""Prefix of the leases of deletions in progress (:mod:`tierckpt.tier2.sweep`)."""

_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_PART_RE = re.compile(r"^objects\.[0-9a-z_-]+\.json$")


def content_key(sha256: str) -> str:
    """The key (relative to the store's prefix) of the object whose bytes hash to
    ``sha256`` (64 lowercase hex digits; anything else is an :class:`IntegrityError`)."""
    if not _HEX_RE.match(sha256):
        raise IntegrityError(f"not a SHA-256 hex digest: {sha256!r}")
    return OBJECTS + sha256


def part_name(tag: str) -> str:
    """Name of an uploader's map part under the step prefix (``tag``: [0-9a-z_-]+)."""
    name = f"objects.{tag}.json"
    if not _PART_RE.match(name):
        raise ValueError(f"map part tag must be [0-9a-z_-]+, got {tag!r}")
    return name


def is_part(name: str) -> bool:
    """Whether ``name`` (a member of a step prefix) is an uploader's map part."""
    return _PART_RE.match(name) is not None and name != MAP


@dataclasses.dataclass(frozen=True, kw_only=True)
class MapEntry:
    """Where one member of a step lives: its object's SHA-256 (hence key), size, CRC32C."""

    name: str
    size: int
    crc32c: int
    sha256: str

    @property
    def key(self) -> str:
        return content_key(self.sha256)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "size": self.size,
                "crc32c": checksum.to_hex(self.crc32c), "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MapEntry:
        e = cls(name=safe_member_name(str(d["name"])), size=int(d["size"]),
                crc32c=checksum.from_hex(str(d["crc32c"])), sha256=str(d["sha256"]))
        if d.get("key") != e.key or e.size < 0:
            raise IntegrityError(f"map entry {e.name!r}: key {d.get('key')!r} is not its "
                                 "content's, or its size is negative")
        return e


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectMap:
    """A step's map (or one uploader's part of it). ``uploaded`` counts the bytes the
    upload(s) that wrote it actually sent (the rest were already on tier 2)."""

    step: int
    manifest_sha256: str
    entries: tuple[MapEntry, ...]
    uploaded: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(sorted(self.entries, key=lambda e: e.name)))

    @property
    def referenced(self) -> int:
        """Bytes the step refers to (whatever uploaded them)."""
        return sum(e.size for e in self.entries)

    def keys(self) -> dict[str, str]:
        """member → object key."""
        return {e.name: e.key for e in self.entries}

    def to_bytes(self, key: bytes | None = None) -> bytes:
        """Canonical bytes with the map's own digest, and its HMAC when ``key`` is given."""
        body: dict[str, Any] = {"map_version": MAP_VERSION, "step": self.step,
                                "manifest_sha256": self.manifest_sha256,
                                "uploaded": self.uploaded,
                                "entries": [e.to_json() for e in self.entries]}
        if key is not None:
            body["map_hmac_sha256"] = hmac.new(key, mf.canonical(body),
                                               hashlib.sha256).hexdigest()
        body["map_sha256"] = hashlib.sha256(mf.canonical(body)).hexdigest()
        return mf.canonical(body)

    @classmethod
    def from_bytes(cls, data: bytes, key: bytes | None = None) -> ObjectMap:
        """Parse and check the map's own digest (and HMAC when ``key`` is set): any damage
        is an :class:`IntegrityError`, a missing or wrong HMAC a :class:`SignatureError`."""
        try:
            body = json.loads(data.decode("utf-8"))
            own = body.pop("map_sha256")
            if not hmac.compare_digest(str(own), hashlib.sha256(mf.canonical(body)).hexdigest()):
                raise IntegrityError("object map is damaged: its own digest does not match")
            sig = body.pop("map_hmac_sha256", None)
            if key is not None and not (isinstance(sig, str) and hmac.compare_digest(
                    sig, hmac.new(key, mf.canonical(body), hashlib.sha256).hexdigest())):
                raise SignatureError("object map is unsigned or its signature does not "
                                     "verify with the configured key")
            if body.get("map_version") != MAP_VERSION:
                raise ValueError(f"unsupported object map version {body.get('map_version')!r}")
            m = cls(step=int(body["step"]), manifest_sha256=str(body["manifest_sha256"]),
                    uploaded=int(body["uploaded"]),
                    entries=tuple(MapEntry.from_json(e) for e in body["entries"]))
        except (IntegrityError, SignatureError):
            raise
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise IntegrityError(f"malformed object map: {e}") from e
        if len({e.name for e in m.entries}) != len(m.entries):
            raise IntegrityError("object map lists a member twice")
        return m

    def check(self, manifest: mf.Manifest, manifest_bytes: bytes, *,
              complete: bool = True) -> None:
        """Raise :class:`IntegrityError` unless this map belongs to ``manifest_bytes`` and
        agrees with every entry it lists (size, CRC32C); with ``complete`` it must list
        exactly the manifest's files (a merged map), else a subset (a part)."""
        if not hmac.compare_digest(self.manifest_sha256, mf.digest(manifest_bytes)):
            raise IntegrityError(f"object map of step {self.step} belongs to another manifest")
        names = {f.name for f in manifest.files}
        for e in self.entries:
            f = manifest.file(e.name) if e.name in names else None
            if f is None or (f.size, f.crc32c) != (e.size, e.crc32c):
                raise IntegrityError(f"object map entry {e.name!r} disagrees with the manifest")
        if complete and {e.name for e in self.entries} != names:
            raise IntegrityError(f"object map of step {self.step} does not list every file")


def merge(parts: Iterable[ObjectMap]) -> ObjectMap:
    """One map from several parts of one step (the same member twice must agree)."""
    parts = list(parts)
    if not parts:
        raise IntegrityError("no object map parts to merge")
    by_name: dict[str, MapEntry] = {}
    for p in parts:
        if (p.step, p.manifest_sha256) != (parts[0].step, parts[0].manifest_sha256):
            raise IntegrityError("object map parts of different checkpoints")
        for e in p.entries:
            if by_name.setdefault(e.name, e) != e:
                raise IntegrityError(f"object map parts disagree about {e.name!r}")
    return ObjectMap(step=parts[0].step, manifest_sha256=parts[0].manifest_sha256,
                     entries=tuple(by_name.values()), uploaded=sum(p.uploaded for p in parts))
