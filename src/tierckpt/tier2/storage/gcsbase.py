"""What both halves of :class:`~tierckpt.tier2.storage.gcs.GCSStorage` stand on: the bucket,
prefix, configuration and client; full object names; every SDK call through
:func:`~tierckpt.tier2.storage.gcsclient.call` (bounded retries) with its errors converted;
a bounded pool for parallel parts and ranges; and the small operations the writes need too
(head with the stored CRC32C, a whole small object verified against it, delete).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from google.api_core import exceptions as gexc
from google.cloud import storage

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.storage.base import (
    BadDigestError,
    ByteCounter,
    ObjectInfo,
    ObjectNotFoundError,
    ThrottleCounter,
    validate_key,
)
from tierckpt.tier2.storage.gcsclient import NETWORK_ERRORS, GCSConfig, call, convert, crc_of
from tierckpt.tier2.storage.pool import run_bounded

T = TypeVar("T")
SDK_ERRORS = (gexc.GoogleAPICallError, *NETWORK_ERRORS)


class GCSBase:
    """Base of :class:`GCSStorage`: its configuration, client, names, errors and small
    operations (the constructor is :class:`GCSStorage`'s)."""

    bucket_name: str
    prefix: str
    url: str
    config: GCSConfig
    _client: storage.Client
    _bucket: storage.Bucket
    _reads: ByteCounter
    throttled: ThrottleCounter

    @property
    def integrity(self) -> str:
        """``crc32c`` or ``md5`` (:attr:`GCSConfig.integrity`)."""
        return self.config.integrity

    @property
    def bytes_read(self) -> int:
        return self._reads.value

    @property
    def client(self) -> storage.Client:
        """The SDK client: for the capability probe, which asks the server directly what it
        supports (every other caller goes through the storage methods)."""
        return self._client

    def object_name(self, key: str) -> str:
        """The full object name of ``key`` under this storage's prefix (validated)."""
        return self._name(key)

    # -- helpers ------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _blob(self, name: str, generation: int | None = None) -> storage.Blob:
        return self._bucket.blob(name, generation=generation)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()`` with retries; an SDK error becomes a :class:`StorageError` naming ``op``
        and ``key``."""
        try:
            return call(self.config, fn, self.throttled)
        except SDK_ERRORS as e:
            raise convert(f"{op} {self.url}/{key}", e) from None

    def _parallel(self, items: list[Any], fn: Callable[[Any], T]) -> list[T]:
        """:func:`~tierckpt.tier2.storage.pool.run_bounded` on ``max_concurrency`` threads."""
        return run_bounded(items, fn, workers=self.config.max_concurrency, name="tierckpt-gcs")

    def _head_blob(self, key: str, name: str | None = None) -> storage.Blob | None:
        """The object's current metadata (size, crc32c, generation), or None if missing."""
        full = self._name(key) if name is None else name
        return self._call("head", key, lambda: self._bucket.get_blob(
            full, timeout=self.config.timeout, retry=None))

    def head(self, key: str) -> ObjectInfo | None:
        b = self._head_blob(key)
        if b is None:
            return None
        return ObjectInfo(key=key, size=int(b.size or 0), crc32c=crc_of(b.crc32c))

    def _download(self, key: str, name: str, generation: int | None, start: int | None = None,
                  end: int | None = None) -> bytes:
        """Bytes ``start..end`` (inclusive; None: the whole object) of ``generation``.

        The body is read in one call (``single_shot_download``): the SDK's default loop
        reads it 8 KiB at a time, ~32k Python iterations per 256 MiB under the GIL, which
        held downloads to 0.5-0.78x obstore's. The read is still bounded per socket read by
        ``read_timeout_s``, and a body that breaks off still raises a network error
        (retried by :func:`call`). Peak memory is about twice the bytes asked for (the body,
        then its copy in the SDK's buffer): ``part_size`` for a range; the whole object
        for :meth:`get_bytes`, which returns it in memory anyway."""
        blob = self._blob(name, generation)
        return self._call("get", key, lambda: blob.download_as_bytes(
            start=start, end=end, raw_download=True, checksum=None,
            single_shot_download=True, timeout=self.config.timeout, retry=None))

    def get_bytes(self, key: str) -> bytes:
        for _attempt in range(self.config.digest_attempts):
            b = self._head_blob(key)
            if b is None:
                raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
            want = crc_of(b.crc32c)
            try:
                data = self._download(key, str(b.name), b.generation)
            except ObjectNotFoundError:
                continue  # replaced between head and get: look again
            if want is None or checksum.extend(0, data) == want:
                self._reads.add(len(data))
                return data
        raise BadDigestError(f"get {self.url}/{key}: bytes do not match the stored crc32c "
                             f"({self.config.digest_attempts} tries)")

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self.get_bytes(key)
        except ObjectNotFoundError:
            return None

    def _delete_name(self, key: str, name: str, generation: int | None = None) -> None:
        """Delete object ``name`` (only that generation when given); a missing one is no
        error (a retried delete whose first attempt succeeded)."""
        with contextlib.suppress(ObjectNotFoundError):
            self._call("delete", key, lambda: self._bucket.delete_blob(
                name, if_generation_match=generation, timeout=self.config.timeout,
                retry=None))

    def delete(self, key: str) -> None:
        self._delete_name(key, self._name(key))

    def _delete_quietly(self, key: str, names: list[str]) -> None:
        """Best-effort removal of temporaries after a failure (what remains is swept by
        :meth:`abort_uploads`); never masks the error being raised."""
        for name in names:
            with contextlib.suppress(StorageError):
                self._delete_name(key, name)
