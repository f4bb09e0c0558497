"""What a tier-2 server supports, and the strongest integrity it lets tierckpt use. Pure.

S3 servers differ exactly where our safety lives (../shared/research/s3.md): full-object
CRC32C checksums are new (2024/25) and many servers ignore or reject them; some ignore
``Content-MD5``; ``If-None-Match: *`` is ignored by some. A probe
(:func:`tierckpt.tier2.storage.s3probe.probe`, on scratch keys under the job's prefix)
fills :class:`Capabilities`; :func:`choose` turns it into the two modes the uploader runs
with:

``IntegrityMode.CRC32C``
    every PUT and part carries the manifest's CRC32C as its checksum, the server verifies
    the bytes on receipt and HEAD reports the full-object CRC32C: end to end, as computed
    when the file was written.
``IntegrityMode.MD5``
    every PUT and part carries ``Content-MD5`` and the server's ETag (the MD5 of the bytes
    it stored) must equal ours — so corruption in transit is caught whether or not the
    server checks ``Content-MD5`` itself; the manifest's CRC32C is stored as object user
    metadata, compared on every HEAD and verified on every download.

``MarkerMode.CREATE_ONLY`` writes ``COMPLETE`` with ``If-None-Match: *``; where a server
ignores it, ``MarkerMode.READBACK`` writes the marker (which carries the save id) and reads it
back — a weaker guarantee: one writer per prefix is then ensured only by tierckpt's own
per-root uploader lock and job lock.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class IntegrityMode(str, enum.Enum):
    CRC32C = "crc32c"
    MD5 = "md5"


class MarkerMode(str, enum.Enum):
    CREATE_ONLY = "create-only"
    READBACK = "readback"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What the probe found. ``None`` for a check that could not run (an earlier one
    failed). ``server`` identifies what was probed (endpoint and bucket, no secrets)."""

    server: str
    basic_ops: bool  # PUT, GET, HEAD, LIST, DELETE of a small object work
    ranged_get: bool | None = None
    multipart: bool | None = None
    crc32c_put_verified: bool | None = None  # a PUT with a wrong CRC32C is rejected
    crc32c_head: bool | None = None  # HEAD reports the full-object CRC32C of a single PUT
    crc32c_multipart: bool | None = None  # FULL_OBJECT multipart CRC32C, reported by HEAD
    md5_verified: bool | None = None  # a PUT with a wrong Content-MD5 is rejected
    etag_is_md5: bool | None = None  # single PUT and part ETags are the MD5 of the bytes
    if_none_match: bool | None = None  # a second create-only PUT is refused
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Capabilities:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["notes"] = tuple(kw.get("notes", ()))
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class Modes:
    """The modes chosen for a server; ``integrity`` None: no mode is safe (do not use it).
    ``weaker`` names what is missing compared to the strongest modes, for a warning."""

    integrity: IntegrityMode | None
    marker: MarkerMode
    weaker: tuple[str, ...] = ()


def choose(c: Capabilities) -> Modes:
    """The strongest integrity and marker modes ``c`` supports."""
    weaker: list[str] = []
    integrity: IntegrityMode | None
    if not c.basic_ops or not c.ranged_get or not c.multipart:
        integrity = None
    elif c.crc32c_put_verified and c.crc32c_head and c.crc32c_multipart:
        integrity = IntegrityMode.CRC32C
    elif c.md5_verified or c.etag_is_md5:
        integrity = IntegrityMode.MD5
        weaker.append("no end-to-end CRC32C on upload (Content-MD5/ETag per request, CRC32C "
                      "in metadata, verified on download)")
    else:
        integrity = None
    if c.if_none_match:
        marker = MarkerMode.CREATE_ONLY
    else:
        marker = MarkerMode.READBACK
        weaker.append("If-None-Match ignored: the marker is written and read back (one "
                      "writer per prefix is ensured by tierckpt's locks only)")
    return Modes(integrity=integrity, marker=marker, weaker=tuple(weaker))


TABLE = (
    ("basic_ops", "PUT/GET/HEAD/LIST/DELETE", "required"),
    ("ranged_get", "ranged GET", "required: parallel downloads"),
    ("multipart", "multipart upload", "required: large shards"),
    ("crc32c_put_verified", "CRC32C verified on PUT", "crc32c mode"),
    ("crc32c_head", "HEAD reports CRC32C", "crc32c mode"),
    ("crc32c_multipart", "full-object CRC32C on multipart", "crc32c mode"),
    ("md5_verified", "Content-MD5 verified", "md5 mode (or ETag)"),
    ("etag_is_md5", "ETag is the MD5 of the bytes", "md5 mode (or Content-MD5)"),
    ("if_none_match", "If-None-Match: * honoured", "create-only marker, else read back"),
)
"""``(field, feature, what tierckpt does with it)`` rows of ``tierckpt doctor``."""
