"""What both halves of :class:`~tierckpt.tier2.storage.azure.AzureStorage` stand on: the
container client, prefix and configuration; full blob names; SDK errors converted to
:class:`StorageError` (naming ``az://container/prefix`` and the key only, never the
account endpoint or a credential); a bounded pool for parallel blocks and ranges; and the
small reads the writes need too (properties with the stored CRC32C, a whole small blob
verified against it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from azure.core.exceptions import AzureError, ClientAuthenticationError, HttpResponseError
from azure.storage.blob import BlobClient, BlobProperties, ContainerClient

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.storage.azureclient import (
    DIGEST_CODES,
    AzureConfig,
    crc_of_metadata,
    error_code,
    http_status,
)
from tierckpt.tier2.storage.base import (
    BadDigestError,
    ByteCounter,
    ObjectInfo,
    ObjectNotFoundError,
    validate_key,
)
from tierckpt.tier2.storage.pool import run_bounded

T = TypeVar("T")
BLOB_NOT_FOUND = "BlobNotFound"


def is_missing_blob(e: AzureError) -> bool:
    """Whether ``e`` says the blob does not exist (not: the container does not)."""
    return isinstance(e, HttpResponseError) and http_status(e) == 404 and \
        error_code(e) in ("", BLOB_NOT_FOUND)


class AzureBase:
    """Base of :class:`AzureStorage`: its configuration, clients, names, errors and small
    reads (the constructor is :class:`AzureStorage`'s)."""

    container: str
    prefix: str
    url: str
    config: AzureConfig
    _container: ContainerClient
    _reads: ByteCounter

    @property
    def integrity(self) -> str:
        """``md5``: see :mod:`tierckpt.tier2.storage.azure`."""
        return "md5"

    @property
    def container_client(self) -> ContainerClient:
        """The SDK's container client: for the capability probe and tests, which ask the
        server directly (every other caller goes through the storage methods)."""
        return self._container

    def blob_name(self, key: str) -> str:
        """The full blob name of ``key`` under this storage's prefix (validated)."""
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _blob(self, key: str) -> BlobClient:
        return self._container.get_blob_client(self.blob_name(key))

    def _err(self, op: str, key: str, e: Exception) -> StorageError:
        """Convert an SDK error; the message names container/key, the service's error code
        and HTTP status only (the SDK's own text carries the account URL)."""
        where = f"{op} {self.url}/{key}"
        if isinstance(e, HttpResponseError) and http_status(e):
            code, status = error_code(e), http_status(e)
            if is_missing_blob(e):
                return ObjectNotFoundError(f"{where}: no such object")
            if code == "ContainerNotFound":
                return StorageError(f"{where}: the container {self.container!r} does not exist")
            if code in DIGEST_CODES:
                return BadDigestError(f"{where}: the service rejected the bytes ({code})")
            if isinstance(e, ClientAuthenticationError) or status in (401, 403):
                return StorageError(f"{where}: credentials refused ({code or 'error'}, HTTP "
                                    f"{status}); check the AZURE_STORAGE_* credentials")
            return StorageError(f"{where}: {code or 'error'} (HTTP {status})")
        return StorageError(f"{where}: {type(e).__name__} after "
                            f"{self.config.max_attempts} attempts")

    def _call(self, op: str, key: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        try:
            return fn(*args, **kw)
        except AzureError as e:
            raise self._err(op, key, e) from None

    def _parallel(self, items: list[Any], fn: Callable[[Any], T]) -> list[T]:
        """:func:`~tierckpt.tier2.storage.pool.run_bounded` on ``max_concurrency`` threads."""
        return run_bounded(items, fn, workers=self.config.max_concurrency, name="tierckpt-az")

    def _props(self, key: str) -> BlobProperties | None:
        """The blob's properties (size, ETag, metadata), or None if it is not committed."""
        try:
            return self._blob(key).get_blob_properties()
        except AzureError as e:
            if is_missing_blob(e):
                return None
            raise self._err("head", key, e) from None

    def head(self, key: str) -> ObjectInfo | None:
        p = self._props(key)
        if p is None:
            return None
        return ObjectInfo(key=key, size=int(p.size), crc32c=crc_of_metadata(p.metadata))

    def get_bytes(self, key: str) -> bytes:
        blob = self._blob(key)
        for attempt in range(max(self.config.digest_attempts, self.config.max_attempts)):
            try:
                dl = blob.download_blob(max_concurrency=1)
                data = dl.readall()
            except AzureError as e:
                if (isinstance(e, HttpResponseError) and http_status(e)) or \
                        attempt + 1 >= self.config.max_attempts:
                    raise self._err("get", key, e) from None
                continue  # the body broke off mid-stream: ask again
            want = crc_of_metadata(dl.properties.metadata)
            if want is None or checksum.extend(0, data) == want:
                self._reads.add(len(data))
                return bytes(data)
            if attempt + 1 >= self.config.digest_attempts:
                raise BadDigestError(f"get {self.url}/{key}: bytes do not match the stored "
                                     f"crc32c {checksum.to_hex(want)}")
        raise AssertionError("unreachable")

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self.get_bytes(key)
        except ObjectNotFoundError:
            return None
