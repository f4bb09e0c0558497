"""The write half of :class:`~tierckpt.tier2.storage.s3.S3Storage`, and the plumbing both
halves share: PUTs and multipart uploads in either integrity mode
(:class:`~tierckpt.tier2.capabilities.IntegrityMode`), create-only puts in either marker mode,
and the small-object reads they need (HEAD, GET of a marker).

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
import concurrent.futures as cf
import contextlib
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import SINGLE_PUT_LIMIT, MarkerMode, UploadMode
from tierckpt.tier2.storage.base import (
    BadDigestError,
    ByteCounter,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    validate_key,
)
from tierckpt.tier2.storage.s3client import (
    DIGEST_CODES,
    MAX_PARTS,
    META_CRC32C,
    NOT_FOUND_CODES,
    STREAM_ERRORS,
    MiB,
    S3Config,
    crc_of,
    crc_of_head,
    error_code,
    http_status,
)

T = TypeVar("T")



def backoff(attempt: int) -> None:
    """Sleep before retry ``attempt`` (50 ms doubling, at most 1 s)."""
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


def _etag_matches(response: dict[str, Any], md5: bytes) -> bool:
    """Whether a PUT/part response's ETag is the MD5 of what we sent (the server hashed
    the bytes it received: corruption in transit shows up here)."""
    return str(response.get("ETag", "")).strip('"').lower() == md5.hex()



class S3Writes:
    """Base of :class:`S3Storage`: its configuration, client and writes."""

    bucket: str
    prefix: str
    url: str
    config: S3Config
    _client: Any
    _md5: bool
    _reads: ByteCounter

    @property
    def integrity(self) -> str:
        """``crc32c`` or ``md5`` (see the module docstring)."""
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

    def _digest_kw(self, crc: int, md5: bytes | None) -> dict[str, Any]:
        """The integrity headers of a PUT: the CRC32C checksum (crc32c mode) or
        Content-MD5 (md5 mode), and the CRC32C as user metadata in both."""
        kw: dict[str, Any] = {"Metadata": {META_CRC32C: checksum.to_hex(crc)}}
        if md5 is None:
            kw["ChecksumCRC32C"] = checksum.to_b64(crc)
        else:
            kw["ContentMD5"] = base64.b64encode(md5).decode("ascii")
        return kw

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self.get_bytes(key)
        except ObjectNotFoundError:
            return None

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
                if md5 is not None and not _etag_matches(r, md5):
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
                    if md5 is None or _etag_matches(r, md5):
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

    def _upload_part(self, key: str, full: str, upload_id: str, fd: int, number: int,
                     offset: int, length: int) -> dict[str, Any]:
        for attempt in range(self.config.digest_attempts):
            data = _pread_full(fd, length, offset)
            if self._md5:
                md5 = hashlib.md5(data).digest()
                try:
                    r = self._client.upload_part(
                        Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                        Body=data, ContentLength=length,
                        ContentMD5=base64.b64encode(md5).decode("ascii"))
                except ClientError as e:
                    if error_code(e) not in DIGEST_CODES or \
                            attempt + 1 == self.config.digest_attempts:
                        raise self._err(f"put part {number}", key, e) from None
                    continue
                except BotoCoreError as e:
                    raise self._err(f"put part {number}", key, e) from None
                if _etag_matches(r, md5):
                    return {"PartNumber": number, "ETag": r["ETag"]}
                if attempt + 1 == self.config.digest_attempts:
                    raise BadDigestError(f"put part {number} {self.url}/{key}: the server "
                                         "stored other bytes than were sent")
                continue
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
        crc_kw = {} if self._md5 else {"ChecksumAlgorithm": "CRC32C",
                                       "ChecksumType": "FULL_OBJECT"}
        mpu = self._call("create upload", key, self._client.create_multipart_upload, Key=full,
                         Metadata={META_CRC32C: checksum.to_hex(crc32c)}, **crc_kw)
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
        crc_kw = {} if self._md5 else {"ChecksumCRC32C": checksum.to_b64(crc32c),
                                       "ChecksumType": "FULL_OBJECT"}
        try:
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, **crc_kw)
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

