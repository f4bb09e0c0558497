"""The write half of :class:`~tierckpt.tier2.storage.azure.AzureStorage`: Put Blob of bytes
and small files, staged blocks for large files, create-only puts, and the check after every
file upload.

Every request that carries bytes carries the ``Content-MD5`` of exactly those bytes, and
Azure refuses the request (``400 Md5Mismatch``) when what arrived differs: a block or put
corrupted in transit is sent again (up to ``digest_attempts``), never stored. The CRC32C of
the same bytes is taken in the same pass over them; before anything becomes visible under
the key (before the Put Blob of a small file is sent, before the Put Block List of a large
one) it must equal the caller's CRC32C and the byte count the caller's size, else
:class:`BadDigestError`. The CRC32C is stored as blob metadata (:data:`META_CRC32C`), so
HEAD reports it and every download is verified against it.

Large files: blocks staged in parallel (Put Block; uncommitted blocks are invisible to
reads and listings), then one Put Block List commits them — the blob appears, or is
replaced, atomically. Block IDs are unique per upload, so an earlier upload's blocks are
never committed by mistake. On a failure the upload's uncommitted blocks are discarded by
deleting the blob when it has no committed version (Azure discards the uncommitted blocks of
a blob that is deleted); where an older version is committed they stay until Azure
garbage-collects them (7 days after the last Put Block) — they are never visible.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import uuid

from azure.core import MatchConditions
from azure.core.exceptions import AzureError, HttpResponseError
from azure.storage.blob import BlobBlock, BlobType

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.storage.azurebase import AzureBase
from tierckpt.tier2.storage.azureclient import (
    DIGEST_CODES,
    MAX_BLOCKS,
    META_CRC32C,
    MiB,
    crc_of_metadata,
    error_code,
    http_status,
)
from tierckpt.tier2.storage.base import BadDigestError, ObjectExistsError, ObjectInfo

EXISTS_CODES = frozenset({"BlobAlreadyExists", "ConditionNotMet"})
"""What Azure answers a create-only put (``If-None-Match: *``) when the blob exists."""


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


def _pread_full(fd: int, length: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < length:
        data = os.pread(fd, length - got, offset + got)
        if not data:
            raise StorageError(f"file shrank while uploading (short read at {offset + got})")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


class AzureWrites(AzureBase):
    """The puts of :class:`AzureStorage`."""

    def _is_digest(self, e: AzureError) -> bool:
        return isinstance(e, HttpResponseError) and error_code(e) in DIGEST_CODES

    def _upload(self, key: str, data: bytes, crc: int, *, create_only: bool) -> None:
        """One Put Blob of ``data`` with its Content-MD5 and CRC32C metadata, resent while
        the service rejects the bytes (up to ``digest_attempts``)."""
        blob = self._blob(key)
        cond = MatchConditions.IfMissing if create_only else None
        for attempt in range(self.config.digest_attempts):
            try:
                blob.upload_blob(data, blob_type=BlobType.BLOCKBLOB, length=len(data),
                                 overwrite=not create_only, max_concurrency=1,
                                 metadata={META_CRC32C: checksum.to_hex(crc)},
                                 headers={"Content-MD5": _md5_b64(data)},
                                 match_condition=cond)
                return
            except AzureError as e:
                if not self._is_digest(e) or attempt + 1 == self.config.digest_attempts:
                    raise
        raise AssertionError("unreachable")

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        data = bytes(data)
        crc = checksum.extend(0, data)
        info = ObjectInfo(key=key, size=len(data), crc32c=crc)
        self.blob_name(key)  # validate before any request
        try:
            self._upload(key, data, crc, create_only=if_none_match)
            return info
        except AzureError as e:
            exists = isinstance(e, HttpResponseError) and (
                error_code(e) in EXISTS_CODES or http_status(e) in (409, 412))
            if not (if_none_match and exists):
                raise self._err("put", key, e) from None
        # The blob exists: ours from an attempt whose response was lost, or another's.
        if self._get_or_none(key) == data:
            return info
        raise ObjectExistsError(f"create-only put {self.url}/{key}: a different object exists")

    def put_file(self, key: str, path: str | os.PathLike[str], *, crc32c: int,
                 size: int) -> ObjectInfo:
        self.blob_name(key)
        try:
            actual = os.stat(path).st_size
        except OSError as e:
            raise StorageError(f"put {self.url}/{key}: cannot read {path}: {e.strerror}") from e
        if actual != size:
            raise BadDigestError(f"put {self.url}/{key}: {path} has {actual} bytes, "
                                 f"expected {size}")
        if size <= self.config.single_put_threshold:
            self._put_single(key, path, crc32c, size)
        else:
            self._put_blocks(key, path, crc32c, size)
        p = self._props(key)
        if p is None or int(p.size) != size:
            stored = int(p.size) if p is not None else "missing"
            raise StorageError(f"put {self.url}/{key}: object missing or wrong size after "
                               f"upload ({stored} != {size})")
        stored_crc = crc_of_metadata(p.metadata)
        if stored_crc != crc32c:
            reported = "none" if stored_crc is None else checksum.to_hex(stored_crc)
            raise BadDigestError(f"put {self.url}/{key}: the store reports crc32c {reported}, "
                                 f"expected {checksum.to_hex(crc32c)}")
        return ObjectInfo(key=key, size=size, crc32c=crc32c)

    def _check(self, key: str, path: str | os.PathLike[str], got: int, want: int) -> None:
        if got != want:
            raise BadDigestError(f"put {self.url}/{key}: {path} has crc32c "
                                 f"{checksum.to_hex(got)}, expected {checksum.to_hex(want)} "
                                 "(changed since it was written)")

    def _put_single(self, key: str, path: str | os.PathLike[str], crc32c: int,
                    size: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = _pread_full(fd, size, 0)
            finally:
                os.close(fd)
        except OSError as e:
            raise StorageError(f"put {self.url}/{key}: cannot read {path}: {e.strerror}") from e
        self._check(key, path, checksum.extend(0, data), crc32c)  # before anything is sent
        try:
            self._upload(key, data, crc32c, create_only=False)
        except AzureError as e:
            raise self._err("put", key, e) from None

    def _put_blocks(self, key: str, path: str | os.PathLike[str], crc32c: int,
                    size: int) -> None:
        # At most 50,000 blocks: grow the block size (in whole MiB) when needed.
        block = max(self.config.block_size, -(-size // (MAX_BLOCKS * MiB)) * MiB)
        token = uuid.uuid4().hex[:16]
        ranges = [(f"{token}-{i:06d}", off, min(block, size - off))
                  for i, off in enumerate(range(0, size, block))]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                crcs = self._parallel(ranges, lambda r: self._stage(key, fd, *r))
            finally:
                os.close(fd)
            got = 0
            for (_, _, length), crc in zip(ranges, crcs, strict=True):
                got = checksum.combine(got, crc, length)
            self._check(key, path, got, crc32c)  # before the commit makes anything visible
            ids = [BlobBlock(block_id=self._block_id(bid)) for bid, _, _ in ranges]
            self._call("commit blocks", key, self._blob(key).commit_block_list, ids,
                       metadata={META_CRC32C: checksum.to_hex(crc32c)})
        except BaseException:
            self._discard(key)
            raise

    @staticmethod
    def _block_id(name: str) -> str:
        return base64.b64encode(name.encode("ascii")).decode("ascii")

    def _stage(self, key: str, fd: int, name: str, offset: int, length: int) -> int:
        """Put Block ``name``: ``length`` bytes of ``fd`` at ``offset``, with their MD5;
        returns the CRC32C of the bytes the service accepted."""
        blob = self._blob(key)
        for attempt in range(self.config.digest_attempts):
            try:
                data = _pread_full(fd, length, offset)
            except OSError as e:
                raise StorageError(f"put {self.url}/{key}: cannot read the file at {offset}: "
                                   f"{e.strerror}") from e
            try:
                blob.stage_block(self._block_id(name), data, length=length,
                                 headers={"Content-MD5": _md5_b64(data)})
                return checksum.extend(0, data)
            except AzureError as e:
                if not self._is_digest(e) or attempt + 1 == self.config.digest_attempts:
                    raise self._err(f"put block at {offset}", key, e) from None
        raise AssertionError("unreachable")

    def _discard(self, key: str) -> None:
        """Drop a failed upload's uncommitted blocks where that cannot touch a committed
        blob (see the module docstring). Best effort: the blocks are invisible either way."""
        with contextlib.suppress(StorageError, AzureError):
            if self._props(key) is None:
                self._blob(key).delete_blob()
