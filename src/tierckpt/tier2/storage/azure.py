"""Azure Blob Storage backend (``az://container/prefix``) on the official
``azure-storage-blob`` SDK, verified end to end.

The account and its credentials come from the environment
(:mod:`tierckpt.tier2.storage.azureclient`: ``AZURE_STORAGE_CONNECTION_STRING``, or
``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_KEY`` or Azure's default credential
chain); messages name only ``az://container/prefix`` and the key.

Integrity: :attr:`integrity` is ``md5``
(:class:`~tierckpt.tier2.capabilities.IntegrityMode`). Azure has no CRC32C checksum of its
own — it verifies a ``Content-MD5`` (or CRC64) sent with each Put Blob and Put Block, and
keeps no full-object checksum of a block-list blob — so ``crc32c`` mode (the store checks
and reports the CRC32C) cannot apply. What this backend does instead, per upload
(:mod:`~tierckpt.tier2.storage.azurewrites`): every request carries the MD5 of its bytes,
which the service checks (corruption in transit is refused, not stored); the CRC32C of the
same bytes, read from the file once, must equal the caller's before the object becomes
visible; the CRC32C is stored as blob metadata, which HEAD reports and every download is
verified against before the file appears under its name.

Downloads use parallel ranged GETs pinned to the blob's ETag (a blob replaced mid-download
fails, it is never mixed), each body streamed into the file piece by piece as it arrives,
its CRC32C taken on the way (:func:`~tierckpt.tier2.storage.azureclient.open_range`).
Retries: transient failures per request in the SDK's pipeline
(:class:`~tierckpt.tier2.storage.azureclient.AzureConfig`); on top, a range whose body
broke off mid-stream, and bytes that fail their checksum (``digest_attempts``).
"""

from __future__ import annotations

import contextlib
import functools
import os

from azure.core.exceptions import AzureError, HttpResponseError

from tierckpt.errors import ConfigError, StorageError
from tierckpt.tier2.storage.azurebase import is_missing_blob
from tierckpt.tier2.storage.azureclient import (
    AzureConfig,
    crc_of_metadata,
    http_status,
    make_service_client,
    open_range,
)
from tierckpt.tier2.storage.azurewrites import AzureWrites
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
from tierckpt.tier2.storage.ranged import (
    Sink,
    get_file_verified,
    range_into_file,
    read_ranges,
)

__all__ = ["AzureConfig", "AzureStorage"]


class AzureStorage(AzureWrites):
    """A :class:`~tierckpt.tier2.storage.base.Storage` over ``az://container/prefix``.

    Opening one sends no request; a missing container or refused credentials show at the
    first call (the job's probe, :mod:`~tierckpt.tier2.storage.azureprobe`, makes that a
    :class:`ConfigError`)."""

    def __init__(self, container: str, prefix: str = "", *,
                 config: AzureConfig | None = None) -> None:
        if not container or "/" in container:
            raise ConfigError(f"Azure container name must be non-empty without '/', got "
                              f"{container!r}")
        self.container = container
        self.prefix = prefix.strip("/")
        if self.prefix:
            validate_key(self.prefix)
        self.config = config or AzureConfig()
        self.url = f"az://{container}/{self.prefix}" if self.prefix else f"az://{container}"
        self.throttled = ThrottleCounter()
        self._service = make_service_client(self.config, self.throttled)
        self._container = self._service.get_container_client(container)
        self._reads = ByteCounter()

    @property
    def bytes_read(self) -> int:
        return self._reads.value

    def __repr__(self) -> str:
        return f"AzureStorage({self.url!r})"

    # -- gets ---------------------------------------------------------------------------
    def _get_range(self, key: str, etag: str | None, offset: int, length: int,
                   sink: Sink) -> None:
        """Hand bytes [offset, offset+length) of ``key`` to ``sink(position, data)`` in
        pieces as they arrive, asking again when the body breaks off mid-stream; with
        ``etag`` the blob must still be that version. A range past the end is a
        :class:`StorageError`."""
        blob = self._blob(key)
        for _attempt in range(self.config.max_attempts):
            pos = offset
            try:
                sent, body = open_range(blob, offset, length, etag)
                with contextlib.closing(body):
                    if sent < length:
                        raise StorageError(f"get {self.url}/{key}: range {offset}+{length} "
                                           "ends past the end of the object")
                    for piece in body:
                        if pos + len(piece) > offset + length:
                            break
                        sink(pos, piece)
                        pos += len(piece)
            except AzureError as e:
                if isinstance(e, HttpResponseError) and http_status(e):
                    if http_status(e) == 416:
                        raise StorageError(f"get {self.url}/{key}: range {offset}+{length} "
                                           "starts past the end of the object") from None
                    raise self._err("get", key, e) from None
                continue  # the body broke off: ask again
            if pos == offset + length:
                return
        raise StorageError(f"get {self.url}/{key}: range at {offset} broke off "
                           f"{self.config.max_attempts} times")

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        if length == 0:
            if self.head(key) is None:
                raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
            return b""
        data = read_ranges(functools.partial(self._get_range, key, None), offset, length,
                           part=self.config.block_size, parallel=self._parallel)
        self._reads.add(length)
        return data

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        p = self._props(key)
        if p is None:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        size, etag = int(p.size), str(p.etag)
        got = get_file_verified(
            f"get {self.url}/{key}", path, size=size,
            want=crc32c if crc32c is not None else crc_of_metadata(p.metadata),
            part=self.config.block_size, attempts=self.config.digest_attempts,
            range_into=functools.partial(range_into_file,
                                         functools.partial(self._get_range, key, etag)),
            parallel=self._parallel)
        self._reads.add(size)
        return ObjectInfo(key=key, size=size, crc32c=got)

    # -- listing and deletion -----------------------------------------------------------
    def _names(self, prefix: str, *, uncommitted: bool = False) -> dict[str, int]:
        """Blob name (relative) -> size of every blob under ``prefix``; with
        ``uncommitted`` also the blobs that have only uncommitted blocks."""
        base = f"{self.prefix}/" if self.prefix else ""
        include = ["uncommittedblobs"] if uncommitted else None
        try:
            return {b.name[len(base):]: int(b.size or 0) for b in self._container.list_blobs(
                name_starts_with=base + prefix, include=include)}
        except AzureError as e:
            raise self._err("list", prefix, e) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        return [ObjectInfo(key=k, size=n) for k, n in sorted(self._names(prefix).items())
                if TMP_MARK not in k]

    def delete(self, key: str) -> None:
        try:
            self._blob(key).delete_blob(delete_snapshots="include")
        except AzureError as e:
            if not is_missing_blob(e):
                raise self._err("delete", key, e) from None

    def abort_uploads(self, prefix: str) -> int:
        """Azure has no upload object to abort: an interrupted upload is a blob with
        uncommitted blocks only. Those (listed with ``include=uncommittedblobs``) are
        deleted, which discards their blocks. Uncommitted blocks staged over a committed
        blob cannot be discarded without rewriting it; they are invisible, and Azure
        garbage-collects them 7 days after the last Put Block."""
        validate_prefix(prefix)
        pending = set(self._names(prefix, uncommitted=True)) - set(self._names(prefix))
        base = f"{self.prefix}/" if self.prefix else ""
        n = 0
        for key in sorted(pending):
            try:
                self._container.get_blob_client(base + key).delete_blob()
                n += 1
            except AzureError as e:
                if not is_missing_blob(e):
                    raise self._err("abort upload", key, e) from None
        return n

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._service.close()

    def __enter__(self) -> AzureStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
