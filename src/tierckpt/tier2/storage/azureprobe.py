"""Probe what an Azure Blob Storage service supports, on scratch blobs under the job's prefix.

:func:`probe` makes about twenty small requests under ``<prefix>/.tierckpt-probe-<id>/`` and
removes everything it wrote, committed or not. The first request (a one-blob listing)
decides whether the service can be used at all: a missing container or refused credentials
is a :class:`~tierckpt.errors.ConfigError` (fix the configuration); no answer and 5xx are a
:class:`~tierckpt.errors.StorageError` (an outage). Every later check records True/False in
:class:`~tierckpt.tier2.capabilities.Capabilities`; the fields mean for Azure:

``multipart``
    staged blocks (Put Block, with their Content-MD5) stay invisible — no properties, not
    listed — until one Put Block List commits them, and then read back whole.
``multipart_list`` / ``multipart_abort``
    a blob with only uncommitted blocks (an interrupted upload) is listed with
    ``include=uncommittedblobs``, and deleting it discards its blocks.
``md5_verified``
    a Put Blob *and* a Put Block whose ``Content-MD5`` does not match the body are refused.
``etag_is_md5``
    the Put Blob response's ETag is the MD5 of the bytes (never, on Azure: ETags are opaque).
``crc32c_*``
    False without a request: Azure has no CRC32C checksum (it checks MD5 or CRC64 per
    request and keeps no checksum of a block-list blob), so tierckpt keeps the CRC32C in
    metadata and verifies it itself (integrity mode ``md5``).
``if_none_match``
    a second Put Blob with ``If-None-Match: *`` is refused and the first blob is kept.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable

from azure.core import MatchConditions
from azure.core.exceptions import AzureError, HttpResponseError
from azure.storage.blob import BlobBlock, BlobClient

from tierckpt.errors import ConfigError, StorageError
from tierckpt.tier2.capabilities import Capabilities
from tierckpt.tier2.storage.azure import AzureStorage
from tierckpt.tier2.storage.azureclient import CREDENTIAL_VARS, error_code, http_status

_CREDENTIAL_CODES = frozenset({"AuthenticationFailed", "AuthorizationFailure",
                               "AuthorizationPermissionMismatch", "InvalidAuthenticationInfo",
                               "NoAuthenticationInformation"})


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


def _block_id(n: int) -> str:
    return base64.b64encode(f"probe-{n:06d}".encode()).decode("ascii")


def _wrong(what: str) -> HttpResponseError:
    """A check that the service answered, but not as it should (recorded in the notes)."""
    return HttpResponseError(message=what)


class _Probe:
    def __init__(self, storage: AzureStorage) -> None:
        self.st, self.c = storage, storage.container_client
        self.base = storage.blob_name(f".tierckpt-probe-{uuid.uuid4().hex[:12]}")
        self.notes: list[str] = []

    def blob(self, name: str) -> BlobClient:
        return self.c.get_blob_client(f"{self.base}/{name}")

    def _note(self, what: str, e: HttpResponseError) -> None:
        status = http_status(e)
        self.notes.append(f"{what}: {error_code(e) or e.message}" +
                          (f" (HTTP {status})" if status else ""))

    def ok(self, what: str, fn: Callable[[], object]) -> bool:
        """Whether ``fn`` succeeds; a refusal is recorded in the notes."""
        try:
            fn()
            return True
        except HttpResponseError as e:
            self._note(what, e)
            return False

    def refused(self, what: str, fn: Callable[[], object]) -> bool:
        """Whether the service refuses ``fn`` (which sends something it must reject)."""
        try:
            fn()
        except HttpResponseError:
            return True
        self.notes.append(f"{what}: accepted")
        return False

    def first_contact(self) -> None:
        where = self.st.url
        try:
            next(iter(self.c.list_blobs(name_starts_with=self.base,
                                        results_per_page=1).by_page()), None)
        except HttpResponseError as e:
            code, status = error_code(e), http_status(e)
            if code == "ContainerNotFound":
                raise ConfigError(f"tier 2 {where}: the container does not exist; create it "
                                  "or fix the container name in the tier2 URL") from None
            if code in _CREDENTIAL_CODES or status in (401, 403):
                raise ConfigError(f"tier 2 {where}: credentials refused ({code or status}); "
                                  f"check {', '.join(CREDENTIAL_VARS)} (or the identity's "
                                  "role on the container)") from None
            raise StorageError(f"tier 2 {where}: {code or 'error'} (HTTP {status})") from None
        except AzureError as e:
            raise StorageError(f"tier 2 {where}: no answer ({type(e).__name__})") from None

    def run(self) -> Capabilities:
        self.first_contact()
        data = os.urandom(4096)
        if not self.ok("PUT/GET/HEAD/LIST/DELETE", lambda: self._basic(data)):
            return Capabilities(server=self.st.url, basic_ops=False, notes=tuple(self.notes))
        ranged = self.ok("ranged GET", lambda: self._ranged(data))
        put_md5 = self.refused("Put Blob with a wrong Content-MD5", lambda: self.blob(
            "badmd5").upload_blob(data, overwrite=True, headers={"Content-MD5": _md5(b"x")}))
        block_md5 = self.refused("Put Block with a wrong Content-MD5", lambda: self.blob(
            "badblock").stage_block(_block_id(0), data, headers={"Content-MD5": _md5(b"x")}))
        etag_md5 = self.ok("ETag of a Put Blob", lambda: self._etag_is_md5(data))
        blocks = self.ok("staged blocks, committed at once", self._blocks)
        listed = self.ok("list blobs with uncommitted blocks", self._list_pending)
        aborted = self.ok("delete a blob of uncommitted blocks", self._abort) if listed else None
        self.notes.append("no CRC32C checksum in Azure Blob Storage (MD5 per request): the "
                          "CRC32C is kept in metadata and verified by tierckpt")
        return Capabilities(
            server=self.st.url, basic_ops=True, ranged_get=ranged, multipart=blocks,
            multipart_list=listed, multipart_abort=aborted, crc32c_put_verified=False,
            crc32c_head=False, crc32c_multipart=False, md5_verified=put_md5 and block_md5,
            etag_is_md5=etag_md5, if_none_match=self._if_none_match(),
            notes=tuple(self.notes))

    def _basic(self, data: bytes) -> None:
        b = self.blob("basic")
        b.upload_blob(data, overwrite=True)
        if b.download_blob().readall() != data:
            raise _wrong("GET returned other bytes")
        if b.get_blob_properties().size != len(data):
            raise _wrong("HEAD reported another size")
        if b.blob_name not in {x.name for x in self.c.list_blobs(name_starts_with=self.base)}:
            raise _wrong("the blob is not listed")
        b.delete_blob()

    def _ranged(self, data: bytes) -> None:
        b = self.blob("range")
        b.upload_blob(data, overwrite=True)
        if b.download_blob(offset=100, length=100).readall() != data[100:200]:
            raise _wrong("a ranged GET returned other bytes")

    def _etag_is_md5(self, data: bytes) -> None:
        r = self.blob("etag").upload_blob(data, overwrite=True, headers={"Content-MD5": _md5(data)})
        if str(r.get("etag", "")).strip('"').lower() != hashlib.md5(data).hexdigest():
            raise _wrong("the ETag is not the MD5 of the bytes")

    def _blocks(self) -> None:
        b, parts = self.blob("blocks"), [os.urandom(1024), os.urandom(512)]
        for n, part in enumerate(parts):
            b.stage_block(_block_id(n), part, headers={"Content-MD5": _md5(part)})
        if b.exists() or b.blob_name in {x.name for x in self.c.list_blobs(
                name_starts_with=self.base)}:
            raise _wrong("uncommitted blocks are visible before the commit")
        b.commit_block_list([BlobBlock(block_id=_block_id(n)) for n in range(len(parts))])
        if b.download_blob().readall() != b"".join(parts):
            raise _wrong("the committed blob has other bytes")

    def _list_pending(self) -> None:
        b = self.blob("pending")
        b.stage_block(_block_id(0), b"pending")
        names = {x.name for x in self.c.list_blobs(name_starts_with=self.base,
                                                   include=["uncommittedblobs"])}
        if b.blob_name not in names:
            raise _wrong("a blob of uncommitted blocks is not listed")

    def _abort(self) -> None:
        b = self.blob("pending")
        b.delete_blob()
        if b.blob_name in {x.name for x in self.c.list_blobs(name_starts_with=self.base,
                                                             include=["uncommittedblobs"])}:
            raise _wrong("the uncommitted blocks are still listed after the delete")

    def _if_none_match(self) -> bool:
        b = self.blob("inm")
        if not self.ok("create-only Put Blob", lambda: b.upload_blob(
                b"first", match_condition=MatchConditions.IfMissing)):
            return False
        if not self.refused("a second create-only Put Blob", lambda: b.upload_blob(
                b"second", overwrite=True, match_condition=MatchConditions.IfMissing)):
            return False
        return bool(b.download_blob().readall() == b"first")

    def cleanup(self) -> None:
        """Delete every scratch blob, committed or only staged (which discards its blocks)."""
        with contextlib.suppress(AzureError):
            for x in list(self.c.list_blobs(name_starts_with=self.base,
                                            include=["uncommittedblobs"])):
                with contextlib.suppress(AzureError):
                    self.c.delete_blob(x.name)


def probe(storage: AzureStorage) -> Capabilities:
    """Probe ``storage``'s service (see the module docstring); scratch blobs are removed.
    ``Capabilities.server`` is the ``az://`` URL (what
    :func:`tierckpt.tier2.probe.server_identity` caches a probe under)."""
    p = _Probe(storage)
    try:
        return p.run()
    except AzureError as e:  # a check that broke off mid-way (no answer, or 5xx after retries)
        raise StorageError(f"probing {storage.url}: {type(e).__name__}") from None
    finally:
        p.cleanup()
