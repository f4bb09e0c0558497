"""S3 (and S3-compatible) backend on boto3, configured explicitly, checksummed end to end.

Endpoint, region and credentials come from the standard AWS chain (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws/config``, instance roles...);
they are never logged or put into error messages, which name only ``s3://bucket/prefix``
and the key.

Integrity on upload: in the mode the server supports (``S3Config.integrity``, chosen by the
job's probe; see :mod:`tierckpt.tier2.storage.s3writes`). Downloads use parallel ranged GETs
(which no client validates) and are verified by recomputing the CRC32C before the file
appears under its name, in every mode.

Retries: botocore's ``standard`` mode retries throttling, 5xx, timeouts and connection
errors per request. On top of that this module retries what botocore does not: a part or
single PUT the server rejected with BadDigest/InvalidDigest (corruption in transit), a
ranged GET whose body broke off mid-stream, a ``409 ConditionalRequestConflict``, and it
resolves the ambiguous cases where a request succeeded but its response was lost
(Complete → NoSuchUpload; create-only put → 412 on its own earlier write).
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier1.fs import fsync_dir, start_writeback
from tierckpt.tier2.capabilities import IntegrityMode, UploadMode
from tierckpt.tier2.storage.base import (
    TMP_MARK,
    BadDigestError,
    ByteCounter,
    ObjectInfo,
    ObjectNotFoundError,
    ThrottleCounter,
    check_range,
    validate_key,
    validate_prefix,
)
from tierckpt.tier2.storage.s3base import backoff
from tierckpt.tier2.storage.s3client import (
    STREAM_ERRORS,
    MiB,
    S3Config,
    count_throttling,
    crc_of_head,
    make_client,
)
from tierckpt.tier2.storage.s3writes import S3Writes


class S3Storage(S3Writes):
    """A :class:`~tierckpt.tier2.storage.base.Storage` over ``s3://bucket/prefix``."""

    def __init__(self, bucket: str, prefix: str = "", *, config: S3Config | None = None,
                 session: boto3.session.Session | None = None) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"S3 bucket name must be non-empty without '/', got {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            validate_key(self.prefix)
        self.config = config or S3Config()
        self._md5 = self.config.integrity == IntegrityMode.MD5.value
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client: Any = make_client(self.config, session)
        self._reads = ByteCounter()
        self.throttled = ThrottleCounter()
        count_throttling(self._client, self.throttled)

    @property
    def bytes_read(self) -> int:
        return self._reads.value

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    # -- gets ---------------------------------------------------------------------------
    def _range_into(self, fd: int, key: str, etag: str | None, r: tuple[int, int]) -> int:
        """Write bytes ``r = (offset, length)`` of ``key`` into ``fd`` at the same offsets;
        returns their CRC32C, taken as they arrive (a retried body starts it over)."""
        offset, length = r
        crc = 0

        def sink(pos: int, data: bytes) -> None:
            nonlocal crc
            if pos == offset:
                crc = 0
            os.pwrite(fd, data, pos)
            crc = checksum.extend(crc, data)

        self._get_range(key, etag, offset, length, sink)
        start_writeback(fd, offset, length)  # on the disk while the other ranges arrive
        return crc

    def _get_range(self, key: str, etag: str | None, offset: int, length: int,
                   sink: Callable[[int, bytes], None]) -> None:
        """Hand bytes [offset, offset+length) of ``key`` to ``sink(position, data)`` in
        pieces, retrying a body that breaks off mid-stream (botocore retries only up to the
        headers); with ``etag`` the object must still be that version."""
        full = self._key(key)
        match = {"IfMatch": etag} if etag is not None else {}
        for attempt in range(self.config.max_attempts):
            r = self._call("get", key, self._client.get_object, Key=full,
                           Range=f"bytes={offset}-{offset + length - 1}", **match)
            pos = offset
            try:
                for chunk in r["Body"].iter_chunks(chunk_size=MiB):
                    if pos + len(chunk) > offset + length:
                        break
                    sink(pos, chunk)
                    pos += len(chunk)
                if pos == offset + length:
                    return
            except STREAM_ERRORS:
                pass
            finally:
                r["Body"].close()
            if pos < offset + length and int(r.get("ContentLength", length)) < length:
                raise StorageError(f"get {self.url}/{key}: range {offset}+{length} ends past "
                                   "the object")
            if attempt + 1 < self.config.max_attempts:
                backoff(attempt)
        raise StorageError(f"get {self.url}/{key}: range at {offset} broke off "
                           f"{self.config.max_attempts} times")

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        if length == 0:
            if self.head(key) is None:
                raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
            return b""
        buf = bytearray(length)
        view = memoryview(buf)

        def sink(pos: int, data: bytes) -> None:
            view[pos - offset:pos - offset + len(data)] = data

        part = self.config.part_size
        parts = [(offset + o, min(part, length - o)) for o in range(0, length, part)]
        self._parallel(parts, lambda p: self._get_range(key, None, p[0], p[1], sink))
        self._reads.add(length)
        return bytes(buf)

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        h = self._head_raw(key)
        if h is None:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        size, etag = int(h["ContentLength"]), str(h["ETag"])
        want = crc32c if crc32c is not None else crc_of_head(h)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{TMP_MARK}{uuid.uuid4().hex}.{dest.name}")
        part = self.config.part_size
        ranges = [(off, min(part, size - off)) for off in range(0, size, part)]
        try:
            for _attempt in range(self.config.digest_attempts):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
                try:
                    os.ftruncate(fd, size)
                    crcs = self._parallel(ranges, functools.partial(self._range_into, fd,
                                                                    key, etag))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                got, n = 0, 0  # the file's CRC32C from the ranges' (taken as they arrived)
                for (_, length), crc in zip(ranges, crcs, strict=True):
                    got, n = checksum.combine(got, crc, length), n + length
                if n == size and (want is None or got == want):
                    os.replace(tmp, dest)
                    fsync_dir(dest.parent)
                    self._reads.add(size)
                    return ObjectInfo(key=key, size=size, crc32c=got)
            raise BadDigestError(f"get {self.url}/{key}: downloaded bytes do not match crc32c "
                                 f"{checksum.to_hex(want or 0)} "
                                 f"({self.config.digest_attempts} tries)")
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise StorageError(f"get {self.url}/{key}: cannot write {path}: {e.strerror}") from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- listing and deletion -----------------------------------------------------------
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[ObjectInfo] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for o in page.get("Contents", ()):
                    out.append(ObjectInfo(key=o["Key"][len(base):], size=int(o["Size"])))
        except (ClientError, BotoCoreError) as e:
            raise self._err("list", prefix, e) from None
        return sorted(out, key=lambda i: i.key)

    def delete(self, key: str) -> None:
        self._call("delete", key, self._client.delete_object, Key=self._key(key))

    def abort_uploads(self, prefix: str) -> int:
        """In upload mode ``single-put`` (a server that cannot list or abort multipart
        uploads) this uploader never starts one: nothing to sweep, no request sent."""
        validate_prefix(prefix)
        if self.config.upload == UploadMode.SINGLE_PUT.value:
            return 0
        base = f"{self.prefix}/" if self.prefix else ""
        n = 0
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for u in page.get("Uploads", ()):
                    with contextlib.suppress(ClientError):  # NoSuchUpload: already gone
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                        n += 1
        except (ClientError, BotoCoreError) as e:
            raise self._err("abort uploads", prefix, e) from None
        return n

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()

    def __enter__(self) -> S3Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
