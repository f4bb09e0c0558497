"""Google Cloud Storage backend (``gs://bucket/prefix``) on the official SDK
(google-cloud-storage), checksummed end to end with CRC32C.

Credentials and endpoint: :mod:`tierckpt.tier2.storage.gcsclient` (application default
credentials; anonymous against ``STORAGE_EMULATOR_HOST``). Messages name only
``gs://bucket/prefix`` and the key.

Uploads: :mod:`tierckpt.tier2.storage.gcswrites` (declared CRC32C, checked by GCS; the
CRC32C the server reports compared with ours after every upload; large files in parallel
parts composed into the object). Downloads are parallel ranged GETs of the generation the
metadata lookup found (a replaced object fails the read instead of mixing two), verified by
recomputing the CRC32C before the file appears under its name.

Retries: every request is retried on 408/429/5xx, timeouts and dropped connections, up to
``max_attempts``, honouring ``Retry-After`` (:func:`~tierckpt.tier2.storage.gcsclient.call`);
the SDK's own retries are off so the bound is ours. Uploads and downloads whose checksum
failed are repeated up to ``digest_attempts``.

Temporaries: parts of an upload in flight are objects named ``<key>.tierckpt-tmp.<id>.<n>``
(:data:`~tierckpt.tier2.storage.base.TMP_MARK`): never listed, deleted when the upload ends
either way, and swept by :meth:`GCSStorage.abort_uploads` after a crash. tierckpt never
starts resumable upload sessions that outlive a call; GCS expires an abandoned resumable
session by itself after a week, and it is not an object (nothing to list or bill).
"""

from __future__ import annotations

import contextlib
import functools
import os

from google.cloud import storage

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier1.fs import start_writeback
from tierckpt.tier2.storage.base import (
    TMP_MARK,
    ByteCounter,
    ObjectInfo,
    ObjectNotFoundError,
    ThrottleCounter,
    check_range,
    validate_key,
    validate_prefix,
)
from tierckpt.tier2.storage.gcsbase import SDK_ERRORS
from tierckpt.tier2.storage.gcsclient import GCSConfig, call, convert, crc_of, make_client
from tierckpt.tier2.storage.gcswrites import GCSWrites
from tierckpt.tier2.storage.ranged import get_file_verified, split

__all__ = ["GCSConfig", "GCSStorage"]


def upload_of(name: str) -> tuple[str, str]:
    """The upload a temporary belongs to: ``(object name, upload id)`` of
    ``<name>.tierckpt-tmp.<id>.<part>``."""
    head, _, tail = name.partition(TMP_MARK)
    return head, tail.split(".", 1)[0]


class GCSStorage(GCSWrites):
    """A :class:`~tierckpt.tier2.storage.base.Storage` over ``gs://bucket/prefix``."""

    def __init__(self, bucket: str, prefix: str = "", *,
                 config: GCSConfig | None = None) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"GCS bucket name must be non-empty without '/', got {bucket!r}")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            validate_key(self.prefix)
        self.config = config or GCSConfig()
        self.url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self._client = make_client(self.config)
        self._bucket = self._client.bucket(bucket)
        self._reads = ByteCounter()
        self.throttled = ThrottleCounter()

    def __repr__(self) -> str:
        return f"GCSStorage({self.url!r})"

    # -- gets ---------------------------------------------------------------------------
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        b = self._head_blob(key)
        if b is None:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        if offset + length > int(b.size or 0):
            raise StorageError(f"get {self.url}/{key}: range {offset}+{length} ends past the "
                               f"object ({b.size} bytes)")
        pieces = self._parallel(split(offset, length, self.config.part_size),
                                lambda r: self._range(key, b, r[0], r[1]))
        self._reads.add(length)
        return b"".join(pieces)

    def _range(self, key: str, b: storage.Blob, offset: int, length: int) -> bytes:
        """Exactly bytes [offset, offset+length) of generation ``b``."""
        data = self._download(key, str(b.name), b.generation, offset, offset + length - 1)
        if len(data) != length:
            raise StorageError(f"get {self.url}/{key}: range {offset}+{length} returned "
                               f"{len(data)} bytes")
        return data

    def _range_into(self, key: str, b: storage.Blob, fd: int, r: tuple[int, int]) -> int:
        """Write bytes ``r = (offset, length)`` of ``b`` into ``fd`` at the same offsets and
        return their CRC32C."""
        offset, length = r
        blob = self._blob(str(b.name), b.generation)

        def attempt() -> _RangeWriter:
            into = _RangeWriter(fd, offset)
            blob.download_to_file(into, start=offset, end=offset + length - 1,
                                  raw_download=True, checksum=None, single_shot_download=True,
                                  timeout=self.config.timeout, retry=None)
            return into

        into = self._call("get", key, attempt)
        if into.pos != offset + length:
            raise StorageError(f"get {self.url}/{key}: range {offset}+{length} returned "
                               f"{into.pos - offset} bytes")
        start_writeback(fd, offset, length)  # on the disk while the other ranges arrive
        return into.crc

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        b = self._head_blob(key)
        if b is None:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        size = int(b.size or 0)
        got = get_file_verified(
            f"get {self.url}/{key}", path, size=size,
            want=crc32c if crc32c is not None else crc_of(b.crc32c),
            part=self.config.part_size, attempts=self.config.digest_attempts,
            range_into=functools.partial(self._range_into, key, b), parallel=self._parallel)
        self._reads.add(size)
        return ObjectInfo(key=key, size=size, crc32c=got)

    # -- listing and deletion -----------------------------------------------------------
    def _names(self, op: str, prefix: str) -> list[tuple[str, int]]:
        """``(full name, size)`` of every object whose name starts with the storage prefix
        plus ``prefix``, temporaries included (a listing broken off is started again)."""
        base = f"{self.prefix}/" if self.prefix else ""

        def listing() -> list[tuple[str, int]]:
            return [(str(o.name), int(o.size or 0)) for o in self._client.list_blobs(
                self._bucket, prefix=base + prefix, timeout=self.config.timeout, retry=None)]

        try:
            return call(self.config, listing, self.throttled)
        except SDK_ERRORS as e:
            raise convert(f"{op} {self.url}/{prefix}", e) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        cut = len(self.prefix) + 1 if self.prefix else 0
        return sorted((ObjectInfo(key=name[cut:], size=size)
                       for name, size in self._names("list", prefix) if TMP_MARK not in name),
                      key=lambda i: i.key)

    def abort_uploads(self, prefix: str) -> int:
        """Delete the temporaries (parts, intermediate composites) of uploads whose key
        starts with ``prefix``; returns how many uploads they belonged to."""
        validate_prefix(prefix)
        stale = [name for name, _ in self._names("abort uploads", prefix) if TMP_MARK in name]
        self._parallel(stale, lambda name: self._delete_name(prefix, name))
        return len({upload_of(name) for name in stale})

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()

    def __enter__(self) -> GCSStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RangeWriter:
    """The file object a ranged ``download_to_file`` writes into: each ``write`` lands in
    ``fd`` at the next position and is folded into the CRC32C. With ``single_shot_download``
    the SDK reads the range's body in one read and writes it once: one range-sized buffer
    per worker, where ``download_as_bytes`` held two (its stream, then the copy returned)."""

    def __init__(self, fd: int, offset: int) -> None:
        self.fd, self.pos, self.crc = fd, offset, 0

    def write(self, data: bytes) -> int:
        os.pwrite(self.fd, data, self.pos)
        self.pos += len(data)
        self.crc = checksum.extend(self.crc, data)
        return len(data)
