"""The write half of :class:`~tierckpt.tier2.storage.s3.S3Storage`: PUTs of bytes and files
in either integrity mode (:class:`~tierckpt.tier2.capabilities.IntegrityMode`), create-only
puts in either marker mode, and the check after every file upload (HEAD: size and CRC32C).
Files above ``multipart_threshold`` go through :mod:`~tierckpt.tier2.storage.s3multipart`;
the client, errors and small reads are :mod:`~tierckpt.tier2.storage.s3base`'s.

crc32c mode: every PUT and part carries the CRC32C the caller computed when the bytes were
written (``x-amz-checksum-crc32c``; multipart: FULL_OBJECT plus one CRC32C per part), the
server rejects bytes that changed, and ``HeadObject(ChecksumMode=ENABLED)`` must report the
same CRC32C after the upload. md5 mode: every PUT and part carries ``Content-MD5`` and the
response's ETag must be the MD5 of what was sent (the server hashed what it received), and
the CRC32C goes into user metadata (``x-amz-meta-tierckpt-crc32c``), compared by HEAD and
verified on every download.

Upload mode (:class:`~tierckpt.tier2.capabilities.UploadMode`): ``multipart`` sends objects
above ``multipart_threshold`` in parallel parts; ``single-put`` (a server without multipart
upload, or without listing or aborting multipart uploads) sends every object in one PUT and
refuses one over S3's 5 GiB single-PUT limit before sending a byte.
"""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import SINGLE_PUT_LIMIT, MarkerMode, UploadMode
from tierckpt.tier2.storage.base import BadDigestError, ObjectExistsError, ObjectInfo
from tierckpt.tier2.storage.s3base import backoff, etag_matches
from tierckpt.tier2.storage.s3client import (
    DIGEST_CODES,
    META_CRC32C,
    MiB,
    crc_of,
    crc_of_head,
    error_code,
    http_status,
)
from tierckpt.tier2.storage.s3multipart import S3Multipart


def _check_file(path: str | os.PathLike[str], crc32c: int, where: str, *,
                md5: bool) -> bytes | None:
    """Check, in one pass, that the file's bytes still have the CRC32C the caller computed
    when they were written (md5 mode has no server-side CRC check): BadDigestError when
    they do not. Returns the file's MD5 when ``md5``."""
    h, crc = hashlib.md5() if md5 else None, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 * MiB):
            if h is not None:
                h.update(chunk)
            crc = checksum.extend(crc, chunk)
    if crc != crc32c:
        raise BadDigestError(f"{where}: {path} has crc32c {checksum.to_hex(crc)}, expected "
                             f"{checksum.to_hex(crc32c)} (changed since it was written)")
    return None if h is None else h.digest()


class S3Writes(S3Multipart):
    """The puts of :class:`S3Storage`."""

    def _digest_kw(self, crc: int, md5: bytes | None) -> dict[str, Any]:
        """The integrity headers of a PUT: the CRC32C checksum (crc32c mode) or
        Content-MD5 (md5 mode), and the CRC32C as user metadata in both."""
        kw: dict[str, Any] = {"Metadata": {META_CRC32C: checksum.to_hex(crc)}}
        if md5 is None:
            kw["ChecksumCRC32C"] = checksum.to_b64(crc)
        else:
            kw["ContentMD5"] = base64.b64encode(md5).decode("ascii")
        return kw

    # -- puts ---------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        full = self._key(key)
        data = bytes(data)
        crc = checksum.extend(0, data)
        info = ObjectInfo(key=key, size=len(data), crc32c=crc)
        md5 = hashlib.md5(data).digest() if self._md5 else None
        kw: dict[str, Any] = {"Key": full, "Body": data, "ContentLength": len(data),
                              **self._digest_kw(crc, md5)}
        readback = if_none_match and self.config.marker == MarkerMode.READBACK.value
        if readback:  # the server ignores If-None-Match: look first, read back after
            existing = self._get_or_none(key)
            if existing is not None:
                if existing == data:
                    return info
                raise ObjectExistsError(
                    f"create-only put {self.url}/{key}: a different object exists")
        elif if_none_match:
            kw["IfNoneMatch"] = "*"
        for attempt in range(self.config.digest_attempts + self.config.max_attempts):
            try:
                r = self._client.put_object(Bucket=self.bucket, **kw)
                if md5 is not None and not etag_matches(r, md5):
                    if attempt + 1 >= self.config.digest_attempts:
                        raise BadDigestError(f"put {self.url}/{key}: the server stored other "
                                             "bytes than were sent (ETag is not their MD5)")
                    backoff(attempt)
                    continue
                if readback and self.get_bytes(key) != data:
                    raise ObjectExistsError(f"create-only put {self.url}/{key}: another "
                                            "writer's object is there (read back)")
                return info
            except ClientError as e:
                code = error_code(e)
                if if_none_match and (code == "PreconditionFailed" or http_status(e) == 412):
                    if self.get_bytes(key) == bytes(data):
                        return ObjectInfo(key=key, size=len(data), crc32c=crc)  # ours, earlier
                    raise ObjectExistsError(
                        f"create-only put {self.url}/{key}: a different object exists") from None
                retry_digest = code in DIGEST_CODES and attempt + 1 < self.config.digest_attempts
                if not (retry_digest or code == "ConditionalRequestConflict"):
                    raise self._err("put", key, e) from None
                backoff(attempt)
            except BotoCoreError as e:
                raise self._err("put", key, e) from None
        raise StorageError(f"put {self.url}/{key}: gave up after repeated conflicts")

    def put_file(self, key: str, path: str | os.PathLike[str], *, crc32c: int,
                 size: int) -> ObjectInfo:
        full = self._key(key)
        try:
            actual = os.stat(path).st_size
        except OSError as e:
            raise StorageError(f"put {self.url}/{key}: cannot read {path}: {e.strerror}") from e
        if actual != size:
            raise BadDigestError(f"put {self.url}/{key}: {path} has {actual} bytes, "
                                 f"expected {size}")
        single = self.config.upload == UploadMode.SINGLE_PUT.value
        if single and size > SINGLE_PUT_LIMIT:
            raise StorageError(
                f"put {self.url}/{key}: {path} has {size} bytes, over S3's "
                f"{SINGLE_PUT_LIMIT // 1024**3} GiB limit of one PUT, and this server offers "
                "no usable multipart upload (upload mode single-put; see `tierckpt doctor`): "
                "use a server that supports multipart upload with listing and abort, or "
                "shard the state over more ranks")
        if single or size <= self.config.multipart_threshold:
            self._put_single(key, full, path, crc32c, size)
        else:
            if self._md5:  # parts carry MD5s only: check the file's CRC32C first
                _check_file(path, crc32c, f"put {self.url}/{key}", md5=False)
            self._put_multipart(key, full, path, crc32c, size)
        h = self._head_raw(key)
        if h is None or int(h["ContentLength"]) != size:
            stored = int(h["ContentLength"]) if h else "missing"
            raise StorageError(f"put {self.url}/{key}: object missing or wrong size after "
                               f"upload ({stored} != {size})")
        info = ObjectInfo(key=key, size=size, crc32c=crc_of_head(h))
        if not self._md5 and crc_of(h.get("ChecksumCRC32C")) is None:
            raise StorageError(f"put {self.url}/{key}: the store reports no full-object "
                               f"CRC32C; it cannot be verified end to end (a server without "
                               f"CRC32C support needs integrity mode md5: see tierckpt doctor)")
        if info.crc32c != crc32c:
            reported = "none" if info.crc32c is None else checksum.to_hex(info.crc32c)
            raise BadDigestError(f"put {self.url}/{key}: store reports crc32c {reported}, "
                                 f"expected {checksum.to_hex(crc32c)}")
        return info

    def _put_single(self, key: str, full: str, path: str | os.PathLike[str], crc32c: int,
                    size: int) -> None:
        md5 = _check_file(path, crc32c, f"put {self.url}/{key}", md5=True) if self._md5 else None
        with open(path, "rb") as f:
            for attempt in range(self.config.digest_attempts):
                f.seek(0)
                try:
                    r = self._client.put_object(Bucket=self.bucket, Key=full, Body=f,
                                                ContentLength=size,
                                                **self._digest_kw(crc32c, md5))
                    if md5 is None or etag_matches(r, md5):
                        return
                    if attempt + 1 == self.config.digest_attempts:
                        raise BadDigestError(f"put {self.url}/{key}: the server stored other "
                                             "bytes than were sent (ETag is not their MD5)")
                except ClientError as e:
                    last = attempt + 1 == self.config.digest_attempts
                    if error_code(e) not in DIGEST_CODES or last:
                        raise self._err("put", key, e) from None
                except BotoCoreError as e:
                    raise self._err("put", key, e) from None

