"""Multipart upload for :class:`~tierckpt.tier2.storage.s3.S3Storage`: one file sent in
parallel parts (``UploadMode.MULTIPART``, above ``multipart_threshold``).

Each part carries its own check in the configured integrity mode: its CRC32C
(``x-amz-checksum-crc32c``; the upload is created with ``FULL_OBJECT`` CRC32C and completed
with the caller's CRC32C of the whole file), or its ``Content-MD5`` with the response's ETag
compared to it. A part the server rejected or stored wrongly is sent again up to
``digest_attempts`` times. The part size grows in whole MiB to stay within S3's 10,000
parts. Any failure aborts the upload, so no unfinished upload is left behind; a Complete
whose response was lost is settled by the object itself (HEAD: size and CRC32C).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.storage.base import BadDigestError
from tierckpt.tier2.storage.s3base import S3Base, etag_matches
from tierckpt.tier2.storage.s3client import DIGEST_CODES, MAX_PARTS, META_CRC32C, MiB, error_code


def _pread_full(fd: int, length: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < length:
        data = os.pread(fd, length - got, offset + got)
        if not data:
            raise StorageError(f"file shrank while uploading (short read at {offset + got})")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


class S3Multipart(S3Base):
    """The multipart upload of :class:`S3Storage` (:meth:`_put_multipart`)."""

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
                if etag_matches(r, md5):
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
