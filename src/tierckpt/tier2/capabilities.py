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

``UploadMode.MULTIPART`` sends large objects in parallel parts and, at each step, aborts the
uploader's own stale multipart uploads (it lists them, then aborts each). A server that
answers "not supported" (HTTP 501 ``NotImplemented``) to multipart upload, to listing
multipart uploads or to aborting one gets ``UploadMode.SINGLE_PUT``: every object in one PUT
(at most :data:`SINGLE_PUT_LIMIT`, S3's limit), no multipart upload is ever started, so
there is nothing to sweep. A 501 on such an optional call is a capability answer, not an
outage.
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


class UploadMode(str, enum.Enum):
    MULTIPART = "multipart"
    SINGLE_PUT = "single-put"


SINGLE_PUT_LIMIT = 5 * 1024**3
"""S3's largest object in one PUT (5 GiB): the largest shard ``UploadMode.SINGLE_PUT`` can
upload."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What the probe found. ``None`` for a check that could not run (an earlier one
    failed). ``server`` identifies what was probed (endpoint and bucket, no secrets)."""

    server: str
    basic_ops: bool  # PUT, GET, HEAD, LIST, DELETE of a small object work
    ranged_get: bool | None = None
    multipart: bool | None = None  # CreateMultipartUpload, UploadPart, Complete work
    multipart_list: bool | None = None  # ListMultipartUploads works (the stale sweep)
    multipart_abort: bool | None = None  # AbortMultipartUpload works (the stale sweep)
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
    upload: UploadMode = UploadMode.MULTIPART


def upload_mode(c: Capabilities) -> UploadMode:
    """Multipart only where the uploader can also find and abort its stale uploads (an
    interrupted upload it cannot abort would keep its parts, billed, forever). ``None``
    (not probed: a probe recorded by an older tierckpt) counts as supported."""
    if c.multipart and c.multipart_list is not False and c.multipart_abort is not False:
        return UploadMode.MULTIPART
    return UploadMode.SINGLE_PUT


def choose(c: Capabilities) -> Modes:
    """The strongest integrity, marker and upload modes ``c`` supports."""
    weaker: list[str] = []
    integrity: IntegrityMode | None
    upload = upload_mode(c)
    if upload is UploadMode.SINGLE_PUT:
        missing = [what for what, ok in (("multipart upload", c.multipart),
                                         ("listing multipart uploads", c.multipart_list),
                                         ("aborting multipart uploads", c.multipart_abort))
                   if ok is False] if c.multipart is not None else ["multipart (not probed)"]
        weaker.append(f"not supported: {', '.join(missing)} — every object goes in one PUT "
                      f"(at most {SINGLE_PUT_LIMIT // 1024**3} GiB each, no parallel parts); "
                      "no stale multipart uploads to sweep")
    crc_multipart = c.crc32c_multipart or upload is UploadMode.SINGLE_PUT
    if not c.basic_ops or not c.ranged_get:
        integrity = None
    elif c.crc32c_put_verified and c.crc32c_head and crc_multipart:
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
    return Modes(integrity=integrity, marker=marker, weaker=tuple(weaker), upload=upload)


TABLE = (
    ("basic_ops", "PUT/GET/HEAD/LIST/DELETE", "required"),
    ("ranged_get", "ranged GET", "required: parallel downloads"),
    ("multipart", "multipart upload", "parallel parts, else one PUT per object (≤ 5 GiB)"),
    ("multipart_list", "list multipart uploads", "stale-upload sweep, else one PUT per object"),
    ("multipart_abort", "abort a multipart upload", "stale-upload sweep, else one PUT per "
                                                   "object"),
    ("crc32c_put_verified", "CRC32C verified on PUT", "crc32c mode"),
    ("crc32c_head", "HEAD reports CRC32C", "crc32c mode"),
    ("crc32c_multipart", "full-object CRC32C on multipart", "crc32c mode"),
    ("md5_verified", "Content-MD5 verified", "md5 mode (or ETag)"),
    ("etag_is_md5", "ETag is the MD5 of the bytes", "md5 mode (or Content-MD5)"),
    ("if_none_match", "If-None-Match: * honoured", "create-only marker, else read back"),
)
"""``(field, feature, what tierckpt does with it)`` rows of ``tierckpt doctor``."""
