"""What both halves of :class:`~tierckpt.tier2.storage.s3.S3Storage` stand on: the bucket,
prefix, configuration and boto3 client; full object keys; botocore errors converted to
:class:`StorageError` (naming bucket and key only, never the endpoint or credentials); a
bounded pool for parallel parts and ranges; and the small reads the writes need too (HEAD
with the stored CRC32C, GET of a whole small object, verified against it).

Retries here: a GET whose body broke off mid-stream (up to ``max_attempts``) or whose bytes
do not match the stored CRC32C (up to ``digest_attempts``); botocore retries the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.storage.base import (
    BadDigestError,
    ByteCounter,
    ObjectInfo,
    ObjectNotFoundError,
    validate_key,
)
from tierckpt.tier2.storage.pool import run_bounded
from tierckpt.tier2.storage.s3client import (
    DIGEST_CODES,
    NOT_FOUND_CODES,
    STREAM_ERRORS,
    S3Config,
    crc_of_head,
    error_code,
    http_status,
)

T = TypeVar("T")


def backoff(attempt: int) -> None:
    """Sleep before retry ``attempt`` (50 ms doubling, at most 1 s)."""
    time.sleep(min(0.05 * 2**attempt, 1.0))


def etag_matches(response: dict[str, Any], md5: bytes) -> bool:
    """Whether a PUT/part response's ETag is the MD5 of what we sent (the server hashed
    the bytes it received: corruption in transit shows up here)."""
    return str(response.get("ETag", "")).strip('"').lower() == md5.hex()


class S3Base:
    """Base of :class:`S3Storage`: its configuration, client, keys, errors and small reads
    (the constructor is :class:`S3Storage`'s)."""

    bucket: str
    prefix: str
    url: str
    config: S3Config
    _client: Any
    _md5: bool
    _reads: ByteCounter

    @property
    def integrity(self) -> str:
        """``crc32c`` or ``md5`` (see :mod:`~tierckpt.tier2.storage.s3writes`)."""
        return self.config.integrity

    @property
    def client(self) -> Any:
        """The boto3 S3 client: for the capability probe, which asks the server directly
        what it supports (every other caller goes through the storage methods)."""
        return self._client

    def object_key(self, key: str) -> str:
        """The full object key of ``key`` under this storage's prefix (validated)."""
        return self._key(key)

    # -- helpers ------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _err(self, op: str, key: str, e: Exception) -> StorageError:
        """Convert a botocore error; the message names bucket/key and the error code only
        (botocore's own text can contain the endpoint URL)."""
        where = f"{op} {self.url}/{key}"
        if isinstance(e, ClientError):
            code = error_code(e)
            if code in NOT_FOUND_CODES:
                return ObjectNotFoundError(f"{where}: no such object")
            if code in DIGEST_CODES:
                return BadDigestError(f"{where}: server rejected the bytes ({code})")
            return StorageError(f"{where}: {code or 'error'} (HTTP {http_status(e)})")
        return StorageError(f"{where}: {type(e).__name__} after retries")

    def _call(self, op: str, key: str, fn: Callable[..., T], **kw: Any) -> T:
        try:
            return fn(Bucket=self.bucket, **kw)
        except (ClientError, BotoCoreError) as e:
            raise self._err(op, key, e) from None

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self.get_bytes(key)
        except ObjectNotFoundError:
            return None

    def _parallel(self, items: list[Any], fn: Callable[[Any], T]) -> list[T]:
        """:func:`~tierckpt.tier2.storage.pool.run_bounded` on ``max_concurrency`` threads."""
        return run_bounded(items, fn, workers=self.config.max_concurrency, name="tierckpt-s3")

    def _head_raw(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self._client.head_object(Bucket=self.bucket, Key=self._key(key),
                                                 ChecksumMode="ENABLED"))
        except ClientError as e:
            if error_code(e) in NOT_FOUND_CODES or http_status(e) == 404:
                return None
            raise self._err("head", key, e) from None
        except BotoCoreError as e:
            raise self._err("head", key, e) from None

    def head(self, key: str) -> ObjectInfo | None:
        h = self._head_raw(key)
        if h is None:
            return None
        return ObjectInfo(key=key, size=int(h["ContentLength"]), crc32c=crc_of_head(h))

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        for attempt in range(self.config.max_attempts):
            r = self._call("get", key, self._client.get_object, Key=full, ChecksumMode="ENABLED")
            try:
                data = r["Body"].read()
            except STREAM_ERRORS:
                backoff(attempt)
                continue
            want = crc_of_head(r)
            if want is None or checksum.extend(0, data) == want:
                self._reads.add(len(data))
                return bytes(data)
            if attempt + 1 >= self.config.digest_attempts:
                raise BadDigestError(f"get {self.url}/{key}: bytes do not match stored crc32c")
        raise StorageError(f"get {self.url}/{key}: body broke off "
                           f"{self.config.max_attempts} times")

