"""Probe what an S3 server supports, on scratch keys under the job's prefix.

:func:`probe` makes about twenty small requests and one 5 MiB multipart upload per mode
under ``<prefix>/.tierckpt-probe-<id>/`` and removes everything it wrote. The first request
(a one-key listing) decides whether the server can be used at all: a missing bucket,
refused credentials or "not supported" (HTTP 501) to the listing is a
:class:`~tierckpt.errors.ConfigError` (fix the configuration); no answer, refused
connections and other 5xx are a :class:`~tierckpt.errors.StorageError` (an outage). Every
later check records True/False in :class:`~tierckpt.tier2.capabilities.Capabilities`, per
feature: an answer of "not supported" (HTTP 501 ``NotImplemented``, ``NotSupported``...) is
noted as such. Listing and aborting multipart uploads (the uploader's stale-upload sweep)
are optional calls with plain requests: there a 4xx or 501 is a capability answer and any
other 5xx (after botocore's retries) an outage, so a server that is down is not recorded as
one that lacks the feature.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import Capabilities
from tierckpt.tier2.storage.s3 import S3Storage
from tierckpt.tier2.storage.s3client import (
    MIN_PART,
    endpoint,
    error_code,
    http_status,
    not_supported,
)

_CREDENTIAL_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "ExpiredToken", "InvalidToken", "TokenRefreshRequired"})


def identity(storage: S3Storage) -> str:
    """Which server and bucket were probed (cache key; no secrets): see
    :func:`tierckpt.tier2.probe.server_identity`."""
    return f"{endpoint() or 'aws'}|{storage.bucket}"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _crc_b64(data: bytes) -> str:
    return checksum.to_b64(checksum.extend(0, data))


def _etag(r: dict[str, Any]) -> str:
    return str(r.get("ETag", "")).strip('"').lower()


class _Probe:
    def __init__(self, storage: S3Storage) -> None:
        self.st, self.c, self.bucket = storage, storage.client, storage.bucket
        self.base = storage.object_key(f".tierckpt-probe-{uuid.uuid4().hex[:12]}")
        self.notes: list[str] = []
        self.sweep: bool | None = None  # whether cleanup can list and abort uploads

    def key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _note(self, what: str, e: ClientError) -> None:
        answer = f"{error_code(e) or 'error'} (HTTP {http_status(e)})"
        self.notes.append(f"{what}: not supported, {answer}" if not_supported(e)
                          else f"{what}: {answer}")

    def ok(self, what: str, fn: Callable[[], object]) -> bool:
        """Whether ``fn`` succeeds; a refusal is recorded in the notes."""
        try:
            fn()
            return True
        except ClientError as e:
            self._note(what, e)
            return False

    def supports(self, what: str, fn: Callable[[], object]) -> bool:
        """Whether the server does ``fn``, an optional call with a plain request: "not
        supported" (501) or a refusal (4xx) is an answer (False, noted); any other 5xx is
        an outage (:class:`StorageError`), not a missing feature."""
        try:
            fn()
            return True
        except ClientError as e:
            status = http_status(e)
            if status >= 500 and not not_supported(e):
                raise StorageError(f"tier 2 s3://{self.bucket}: {what}: "
                                   f"{error_code(e) or 'error'} (HTTP {status})") from None
            self._note(what, e)
            return False

    def refused(self, what: str, fn: Callable[[], object]) -> bool:
        """Whether the server refuses ``fn`` (which sends something it must reject)."""
        try:
            fn()
        except ClientError:
            return True
        self.notes.append(f"{what}: accepted")
        return False

    def first_contact(self) -> None:
        try:
            self.c.list_objects_v2(Bucket=self.bucket, Prefix=self.base, MaxKeys=1)
        except ClientError as e:
            code, status = error_code(e), http_status(e)
            where = f"s3://{self.bucket}"
            if code == "NoSuchBucket":
                raise ConfigError(f"tier 2 {where}: the bucket does not exist; create it or "
                                  "fix the bucket name in the tier2 URL") from None
            if code in _CREDENTIAL_CODES or status in (401, 403):
                raise ConfigError(f"tier 2 {where}: credentials refused ({code or status}); "
                                  "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the "
                                  "profile) and the bucket policy") from None
            if not_supported(e):
                raise ConfigError(f"tier 2 {where}: the server does not support listing "
                                  f"objects (ListObjectsV2: {code or 'error'}, HTTP {status}), "
                                  "which tierckpt needs; use another server") from None
            raise StorageError(f"tier 2 {where}: {code or 'error'} (HTTP {status})") from None
        except BotoCoreError as e:
            raise StorageError(f"tier 2 s3://{self.bucket}: no answer "
                               f"({type(e).__name__})") from None

    def run(self) -> Capabilities:
        self.first_contact()
        c, b, k = self.c, self.bucket, self.key
        data = os.urandom(4096)
        md5 = hashlib.md5(data).digest()
        basic = self.ok("PUT/GET/HEAD/LIST", lambda: self._basic(data))
        if not basic:
            return Capabilities(server=identity(self.st), basic_ops=False,
                                notes=tuple(self.notes))
        ranged = self.ok("ranged GET", lambda: self._ranged(data))
        crc_put = self.ok("PUT with CRC32C", lambda: c.put_object(
            Bucket=b, Key=k("crc"), Body=data, ChecksumCRC32C=_crc_b64(data)))
        crc_head = crc_put and self._head_crc(k("crc")) == _crc_b64(data)
        crc_verified = crc_put and self.refused("PUT with a wrong CRC32C", lambda: c.put_object(
            Bucket=b, Key=k("badcrc"), Body=data, ChecksumCRC32C=_crc_b64(data + b"x")))
        md5_verified = self.refused("PUT with a wrong Content-MD5", lambda: c.put_object(
            Bucket=b, Key=k("badmd5"), Body=data, ContentMD5=_b64(hashlib.md5(b"x").digest())))
        etag_single = self.ok("PUT with Content-MD5", lambda: self._etag_is(
            c.put_object(Bucket=b, Key=k("md5"), Body=data, ContentMD5=_b64(md5)), md5))
        inm = self._if_none_match()
        mp_list = self.supports("list multipart uploads", lambda: c.list_multipart_uploads(
            Bucket=b, Prefix=self.base, MaxUploads=1))
        mp_md5 = self.ok("multipart with Content-MD5", lambda: self._multipart(crc=False))
        mp_crc = crc_head and self.ok("multipart with FULL_OBJECT CRC32C",
                                      lambda: self._multipart(crc=True))
        multipart = mp_md5 or mp_crc
        mp_abort = self.supports("abort a multipart upload", self._abort) if multipart else None
        self.sweep = mp_list and bool(mp_abort)
        return Capabilities(
            server=identity(self.st), basic_ops=True, ranged_get=ranged,
            multipart=multipart, multipart_list=mp_list, multipart_abort=mp_abort,
            crc32c_put_verified=crc_verified, crc32c_head=crc_head, crc32c_multipart=mp_crc,
            md5_verified=md5_verified,
            # without multipart (single PUTs only) no part ETag needs to be an MD5
            etag_is_md5=etag_single and (mp_md5 or not multipart),
            if_none_match=inm, notes=tuple(self.notes))

    def _basic(self, data: bytes) -> None:
        c, b, key = self.c, self.bucket, self.key("basic")
        c.put_object(Bucket=b, Key=key, Body=data)
        if c.get_object(Bucket=b, Key=key)["Body"].read() != data:
            raise ClientError({"Error": {"Code": "WrongBytes"}}, "GetObject")
        if int(c.head_object(Bucket=b, Key=key)["ContentLength"]) != len(data):
            raise ClientError({"Error": {"Code": "WrongSize"}}, "HeadObject")
        listed = c.list_objects_v2(Bucket=b, Prefix=self.base).get("Contents", [])
        if key not in {o["Key"] for o in listed}:
            raise ClientError({"Error": {"Code": "NotListed"}}, "ListObjectsV2")
        c.delete_object(Bucket=b, Key=key)

    def _ranged(self, data: bytes) -> None:
        key = self.key("range")
        self.c.put_object(Bucket=self.bucket, Key=key, Body=data)
        got = self.c.get_object(Bucket=self.bucket, Key=key, Range="bytes=100-199")
        if got["Body"].read() != data[100:200]:
            raise ClientError({"Error": {"Code": "WrongRange"}}, "GetObject")

    def _head_crc(self, key: str) -> str | None:
        with contextlib.suppress(ClientError):
            return self.c.head_object(Bucket=self.bucket, Key=key,
                                      ChecksumMode="ENABLED").get("ChecksumCRC32C")
        return None

    @staticmethod
    def _etag_is(r: dict[str, Any], md5: bytes) -> None:
        if _etag(r) != md5.hex():
            raise ClientError({"Error": {"Code": "ETagIsNotMD5"}}, "PutObject")

    def _if_none_match(self) -> bool:
        c, b, key = self.c, self.bucket, self.key("inm")
        if not self.ok("create-only PUT", lambda: c.put_object(
                Bucket=b, Key=key, Body=b"first", IfNoneMatch="*")):
            return False
        if not self.refused("a second create-only PUT", lambda: c.put_object(
                Bucket=b, Key=key, Body=b"second", IfNoneMatch="*")):
            return False
        return bool(c.get_object(Bucket=b, Key=key)["Body"].read() == b"first")

    def _multipart(self, *, crc: bool) -> None:
        """A two-part upload (5 MiB + 1 KiB); md5 mode also checks part ETags."""
        c, b = self.c, self.bucket
        key = self.key("mp-crc" if crc else "mp-md5")
        parts_data = [os.urandom(MIN_PART), os.urandom(1024)]
        kw: dict[str, Any] = {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"} \
            if crc else {}
        uid = c.create_multipart_upload(Bucket=b, Key=key, **kw)["UploadId"]
        try:
            parts = []
            for n, part in enumerate(parts_data, 1):
                extra = {"ChecksumCRC32C": _crc_b64(part)} if crc else \
                    {"ContentMD5": _b64(hashlib.md5(part).digest())}
                r = c.upload_part(Bucket=b, Key=key, UploadId=uid, PartNumber=n, Body=part,
                                  **extra)
                if not crc:
                    self._etag_is(r, hashlib.md5(part).digest())
                parts.append({"PartNumber": n, "ETag": r["ETag"], **(
                    {"ChecksumCRC32C": extra["ChecksumCRC32C"]} if crc else {})})
            whole = b"".join(parts_data)
            done = {"ChecksumCRC32C": _crc_b64(whole), "ChecksumType": "FULL_OBJECT"} \
                if crc else {}
            c.complete_multipart_upload(Bucket=b, Key=key, UploadId=uid,
                                        MultipartUpload={"Parts": parts}, **done)
        except BaseException:
            with contextlib.suppress(ClientError, BotoCoreError):
                c.abort_multipart_upload(Bucket=b, Key=key, UploadId=uid)
            raise
        if crc and self._head_crc(key) != _crc_b64(whole):
            raise ClientError({"Error": {"Code": "NoFullObjectCRC32C"}}, "HeadObject")

    def _abort(self) -> None:
        """Start an upload and abort it. A server that refuses the abort gets the upload
        completed (one tiny part) instead, so cleanup can delete what is left."""
        c, b, key = self.c, self.bucket, self.key("mp-abort")
        uid = c.create_multipart_upload(Bucket=b, Key=key)["UploadId"]
        try:
            c.abort_multipart_upload(Bucket=b, Key=key, UploadId=uid)
        except ClientError:
            with contextlib.suppress(ClientError, BotoCoreError):
                etag = c.upload_part(Bucket=b, Key=key, UploadId=uid, PartNumber=1,
                                     Body=b"x")["ETag"]
                c.complete_multipart_upload(Bucket=b, Key=key, UploadId=uid, MultipartUpload={
                    "Parts": [{"PartNumber": 1, "ETag": etag}]})
            raise

    def cleanup(self) -> None:
        """Delete the scratch objects, then abort unfinished scratch uploads — unless the
        server cannot list or abort them (nothing to ask it then)."""
        with contextlib.suppress(ClientError, BotoCoreError):
            for o in self.c.list_objects_v2(Bucket=self.bucket,
                                            Prefix=self.base).get("Contents", []):
                self.c.delete_object(Bucket=self.bucket, Key=o["Key"])
        if self.sweep is not False:
            with contextlib.suppress(StorageError):
                self.st.abort_uploads(self.base.removeprefix(f"{self.st.prefix}/"))


def probe(storage: S3Storage) -> Capabilities:
    """Probe ``storage``'s server (see the module docstring); scratch keys are removed."""
    p = _Probe(storage)
    try:
        return p.run()
    except (ClientError, BotoCoreError) as e:  # a check that broke off mid-way
        raise StorageError(f"probing {storage.url}: {type(e).__name__}") from None
    finally:
        p.cleanup()
