"""S3 (and S3-compatible) backend on boto3, configured explicitly, checksummed end to end.

Endpoint, region and credentials come from the standard AWS chain (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws/config``, instance roles...);
they are never logged or put into error messages, which name only ``s3://bucket/prefix``
and the key.

Integrity: every put carries the CRC32C the caller computed when the bytes were written
(``x-amz-checksum-crc32c``; for multipart uploads a FULL_OBJECT checksum plus one CRC32C
per part), so the server rejects bytes that changed anywhere between the original write
and the store. After a put, ``HeadObject(ChecksumMode=ENABLED)`` must report the same
size and CRC32C. Downloads use parallel ranged GETs (which no client validates) and are
verified by recomputing the CRC32C before the file appears under its name.

Retries: botocore's ``standard`` mode retries throttling, 5xx, timeouts and connection
errors per request. On top of that this module retries what botocore does not: a part or
single PUT the server rejected with BadDigest/InvalidDigest (corruption in transit), a
ranged GET whose body broke off mid-stream, a ``409 ConditionalRequestConflict``, and it
resolves the ambiguous cases where a request succeeded but its response was lost
(Complete → NoSuchUpload; create-only put → 412 on its own earlier write).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier1.fs import fsync_dir
from tierckpt.tier2.storage.base import (
    TMP_MARK,
    BadDigestError,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    validate_key,
    validate_prefix,
)
from tierckpt.tier2.storage.s3client import (
    DIGEST_CODES,
    MAX_PARTS,
    NOT_FOUND_CODES,
    STREAM_ERRORS,
    MiB,
    S3Config,
    crc_of,
    error_code,
    http_status,
    make_client,
)

T = TypeVar("T")


def _backoff(attempt: int) -> None:
    time.sleep(min(0.05 * 2**attempt, 1.0))


def _pread_full(fd: int, length: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < length:
        data = os.pread(fd, length - got, offset + got)
        if not data:
            raise StorageError(f"file shrank while uploading (short read at {offset + got})")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


class S3Storage:
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
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client: Any = make_client(self.config, session)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

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

    # -- puts ---------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        full = self._key(key)
        crc = checksum.extend(0, data)
        kw: dict[str, Any] = {"Key": full, "Body": bytes(data), "ContentLength": len(data),
                              "ChecksumCRC32C": checksum.to_b64(crc)}
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        for attempt in range(self.config.digest_attempts + self.config.max_attempts):
            try:
                self._client.put_object(Bucket=self.bucket, **kw)
                return ObjectInfo(key=key, size=len(data), crc32c=crc)
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
                _backoff(attempt)
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
        if size <= self.config.multipart_threshold:
            self._put_single(key, full, path, crc32c, size)
        else:
            self._put_multipart(key, full, path, crc32c, size)
        info = self.head(key)
        if info is None or info.size != size:
            raise StorageError(f"put {self.url}/{key}: object missing or wrong size after "
                               f"upload ({info.size if info else 'missing'} != {size})")
        if info.crc32c is None:
            raise StorageError(f"put {self.url}/{key}: the store reports no full-object "
                               f"CRC32C; it cannot be verified end to end")
        if info.crc32c != crc32c:
            raise BadDigestError(f"put {self.url}/{key}: store reports crc32c "
                                 f"{checksum.to_hex(info.crc32c)}, expected "
                                 f"{checksum.to_hex(crc32c)}")
        return info

    def _put_single(self, key: str, full: str, path: str | os.PathLike[str], crc32c: int,
                    size: int) -> None:
        with open(path, "rb") as f:
            for attempt in range(self.config.digest_attempts):
                f.seek(0)
                try:
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=f,
                                            ContentLength=size,
                                            ChecksumCRC32C=checksum.to_b64(crc32c))
                    return
                except ClientError as e:
                    last = attempt + 1 == self.config.digest_attempts
                    if error_code(e) not in DIGEST_CODES or last:
                        raise self._err("put", key, e) from None
                except BotoCoreError as e:
                    raise self._err("put", key, e) from None

    def _upload_part(self, key: str, full: str, upload_id: str, fd: int, number: int,
                     offset: int, length: int) -> dict[str, Any]:
        for attempt in range(self.config.digest_attempts):
            data = _pread_full(fd, length, offset)
            b64 = checksum.to_b64(checksum.extend(0, data))
            try:
                r = self._client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                    Body=data, ContentLength=length, ChecksumCRC32C=b64)
                return {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32C": b64}
            except ClientError as e:
                if error_code(e) not in DIGEST_CODES or attempt + 1 == self.config.digest_attempts:
                    raise self._err(f"put part {number}", key, e) from None
            except BotoCoreError as e:
                raise self._err(f"put part {number}", key, e) from None
        raise AssertionError("unreachable")

    def _put_multipart(self, key: str, full: str, path: str | os.PathLike[str], crc32c: int,
                       size: int) -> None:
        # S3 allows at most 10,000 parts: grow the part size (in whole MiB) when needed.
        part = max(self.config.part_size, -(-size // (MAX_PARTS * MiB)) * MiB)
        mpu = self._call("create upload", key, self._client.create_multipart_upload, Key=full,
                         ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT")
        upload_id = mpu["UploadId"]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                ranges = [(i + 1, off, min(part, size - off))
                          for i, off in enumerate(range(0, size, part))]
                parts = self._parallel(ranges, lambda r: self._upload_part(
                    key, full, upload_id, fd, r[0], r[1], r[2]))
            finally:
                os.close(fd)
            self._complete(key, full, upload_id, parts, crc32c, size)
        except BaseException:
            with contextlib.suppress(ClientError, BotoCoreError):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full,
                                                    UploadId=upload_id)
            raise

    def _complete(self, key: str, full: str, upload_id: str, parts: list[dict[str, Any]],
                  crc32c: int, size: int) -> None:
        try:
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, ChecksumCRC32C=checksum.to_b64(crc32c),
                ChecksumType="FULL_OBJECT")
        except ClientError as e:
            # A retried Complete whose first attempt succeeded (response lost) finds no
            # upload: the object itself decides. Each part was verified on its own, so a
            # digest error here means the file does not match the CRC32C the caller gave:
            # retrying cannot help.
            if error_code(e) == "NoSuchUpload":
                info = self.head(key)
                if info is not None and info.size == size and info.crc32c == crc32c:
                    return
            raise self._err("complete upload", key, e) from None
        except BotoCoreError as e:
            raise self._err("complete upload", key, e) from None

    def _parallel(self, items: list[Any], fn: Callable[[Any], T]) -> list[T]:
        """Run ``fn`` over ``items`` on a bounded pool; the first failure cancels the rest
        and is raised after every started call has returned."""
        if len(items) <= 1:
            return [fn(i) for i in items]
        with cf.ThreadPoolExecutor(min(self.config.max_concurrency, len(items)),
                                   thread_name_prefix="tierckpt-s3") as ex:
            futs = [ex.submit(fn, i) for i in items]
            _done, pending = cf.wait(futs, return_when=cf.FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in futs:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    cf.wait(futs)
                    raise f.exception()  # type: ignore[misc]
            return [f.result() for f in futs]

    # -- gets ---------------------------------------------------------------------------
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
        return ObjectInfo(key=key, size=int(h["ContentLength"]),
                          crc32c=crc_of(h.get("ChecksumCRC32C")))

    def _get_range(self, key: str, etag: str, fd: int, offset: int, length: int) -> None:
        """Write bytes [offset, offset+length) of ``key`` at ``offset`` of ``fd``, retrying
        a body that breaks off mid-stream (botocore retries only up to the headers)."""
        full = self._key(key)
        for attempt in range(self.config.max_attempts):
            r = self._call("get", key, self._client.get_object, Key=full, IfMatch=etag,
                           Range=f"bytes={offset}-{offset + length - 1}")
            pos = offset
            try:
                for chunk in r["Body"].iter_chunks(chunk_size=MiB):
                    os.pwrite(fd, chunk, pos)
                    pos += len(chunk)
                if pos == offset + length:
                    return
            except STREAM_ERRORS:
                pass
            finally:
                r["Body"].close()
            if attempt + 1 < self.config.max_attempts:
                _backoff(attempt)
        raise StorageError(f"get {self.url}/{key}: range at {offset} broke off "
                           f"{self.config.max_attempts} times")

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        h = self._head_raw(key)
        if h is None:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        size, etag = int(h["ContentLength"]), str(h["ETag"])
        want = crc32c if crc32c is not None else crc_of(h.get("ChecksumCRC32C"))
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
                    self._parallel(ranges, lambda r, fd=fd: self._get_range(  # type: ignore[misc]
                        key, etag, fd, r[0], r[1]))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                got, n = checksum.of_file(tmp)
                if n == size and (want is None or got == want):
                    os.replace(tmp, dest)
                    fsync_dir(dest.parent)
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

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        for attempt in range(self.config.max_attempts):
            r = self._call("get", key, self._client.get_object, Key=full, ChecksumMode="ENABLED")
            try:
                data = r["Body"].read()
            except STREAM_ERRORS:
                _backoff(attempt)
                continue
            want = crc_of(r.get("ChecksumCRC32C"))
            if want is None or checksum.extend(0, data) == want:
                return bytes(data)
            if attempt + 1 >= self.config.digest_attempts:
                raise BadDigestError(f"get {self.url}/{key}: bytes do not match stored crc32c")
        raise StorageError(f"get {self.url}/{key}: body broke off "
                           f"{self.config.max_attempts} times")

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
        validate_prefix(prefix)
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
