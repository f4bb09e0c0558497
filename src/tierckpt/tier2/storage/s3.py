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
from collections.abc import Callable
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import ConfigError, StorageError
from tierckpt.tier2.capabilities import IntegrityMode, UploadMode
from tierckpt.tier2.storage.base import (
    ByteCounter,
    ObjectInfo,
    ObjectNotFoundError,
    ThrottleCounter,
    check_range,
    validate_key,
    validate_prefix,
)
from tierckpt.tier2.storage.ranged import get_file_verified, range_into_file, read_ranges
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
        data = read_ranges(functools.partial(self._get_range, key, None), offset, length,
                           part=self.config.part_size, parallel=self._parallel)
        self._reads.add(length)
        return data

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        h = self._head_raw(key)
        if h is None:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        size, etag = int(h["ContentLength"]), str(h["ETag"])
        got = get_file_verified(
            f"get {self.url}/{key}", path, size=size,
            want=crc32c if crc32c is not None else crc_of_head(h),
            part=self.config.part_size, attempts=self.config.digest_attempts,
            range_into=functools.partial(range_into_file,
                                         functools.partial(self._get_range, key, etag)),
            parallel=self._parallel)
        self._reads.add(size)
        return ObjectInfo(key=key, size=size, crc32c=got)

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
