"""Azure Blob Storage client set-up: :class:`AzureConfig`, the credential chain, the retry
policy, and reading the SDK's errors. Used by :mod:`tierckpt.tier2.storage.azure`.

Credentials, first match wins (the account key and connection string never appear in a
message; only the variable names do):

1. ``AZURE_STORAGE_CONNECTION_STRING`` (any endpoint: Azurite, a sovereign cloud, a
   private endpoint; ``BlobEndpoint=`` in it names the service URL);
2. ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_KEY`` (shared key, public cloud
   endpoint ``https://<account>.blob.core.windows.net``);
3. ``AZURE_STORAGE_ACCOUNT_NAME`` alone: ``azure.identity.DefaultAzureCredential``
   (managed identity, workload identity, ``az login``...) when azure-identity is installed.

Retries: every request goes through :class:`_Retry` (azure-core's policy, which retries
408, 429, 500, 502, 503 and 504, connection errors and read timeouts, with exponential
backoff, and sleeps for a ``Retry-After`` the server sends, capped at
``AzureConfig.max_retry_after_s``), at most ``max_attempts`` times per request. The
storage SDK's default policy neither retries 429 nor honours ``Retry-After``.

This module is the fence around the SDK's internals (tested with azure-storage-blob
:data:`TESTED`): the retry options its pipeline leaves for its own policy
(:class:`_Retry`), and the ranged read of :func:`open_range`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Generator, Iterator, Mapping
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import AzureError
from azure.core.pipeline import PipelineRequest, PipelineResponse
from azure.core.pipeline.policies import RetryPolicy
from azure.storage.blob import BlobClient, BlobServiceClient
from azure.storage.blob import __version__ as SDK_VERSION

from tierckpt.errors import ConfigError
from tierckpt.format import checksum
from tierckpt.tier2.storage.base import ThrottleCounter

MiB = 1024 * 1024
MAX_BLOCKS = 50_000  # Azure's largest committed block list
MAX_BLOCK = 4000 * MiB  # Azure's largest block (service version 2019-12-12 and later)
MAX_SINGLE_PUT = 5000 * MiB  # Azure's largest Put Blob
CONNECTION_STRING_VAR = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_VAR = "AZURE_STORAGE_ACCOUNT_NAME"
KEY_VAR = "AZURE_STORAGE_KEY"
CREDENTIAL_VARS = (CONNECTION_STRING_VAR, ACCOUNT_VAR, KEY_VAR)
"""The environment variables the credential chain reads, for messages and tests."""
META_CRC32C = "tierckpt_crc32c"
"""Blob metadata name (``x-ms-meta-tierckpt_crc32c``) of the object's CRC32C, hex. Azure
metadata names must be C# identifiers: ``_``, not ``-``."""
DIGEST_CODES = frozenset({"Md5Mismatch", "InvalidMd5", "Crc64Mismatch"})
"""Error codes with which Azure rejects a body that does not match its Content-MD5."""
TESTED: tuple[str, ...] = ("12.31",)
"""The azure-storage-blob releases (major.minor) whose internals this module was tested
with; on others :func:`open_range` takes the SDK's public (slower) path."""
READ_PIECE = MiB
"""The pieces a download's body is read in (the SDK's ``connection_data_block_size``; its
default is 4 KiB): one read call and one buffer per piece, 16 per 16 MiB range. Measured
against 2 and 4 MiB on Azurite: no faster, more client CPU, more memory per worker."""
_ACCOUNT_RE = re.compile(r"[a-z0-9]{3,24}")
_STORAGE_RETRY_OPTIONS = ("hosts", "location_mode", "retry_to_secondary", "retry_hook")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AzureConfig:
    """Transfer, retry and timeout settings of :class:`~tierckpt.tier2.storage.azure.AzureStorage`
    (sizes in bytes)."""

    block_size: int = 8 * MiB
    """Size of each staged block (Put Block) and of each ranged download; 64 KiB..4000 MiB.
    Grown automatically for files that would otherwise need more than 50,000 blocks."""
    single_put_threshold: int = 16 * MiB
    """Files of at most this size go in one Put Blob (read into memory once); larger ones
    in staged blocks, committed by one Put Block List. At most 5000 MiB."""
    max_concurrency: int = 8
    """Parallel blocks / ranges per object (the SDK keeps at most 10 connections open;
    above that, connections are opened per request)."""
    max_attempts: int = 5
    """Attempts per request (transient errors: 408/429/5xx, connection errors, timeouts),
    and per range of a download whose body broke off."""
    digest_attempts: int = 3
    """Attempts of a block, single put or download whose bytes failed their checksum."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    """Per socket read; a stalled connection fails after this and is retried."""
    backoff_s: float = 0.2
    """Backoff before the third attempt of a request (doubling after; the second attempt
    goes at once), unless the server sent ``Retry-After``."""
    max_retry_after_s: float = 30.0
    """The longest ``Retry-After`` honoured; a longer one is waited this long."""

    def __post_init__(self) -> None:
        if not 64 * 1024 <= self.block_size <= MAX_BLOCK:
            raise ConfigError(f"AzureConfig.block_size must be 64 KiB..4000 MiB, got "
                              f"{self.block_size}")
        if not 0 <= self.single_put_threshold <= MAX_SINGLE_PUT:
            raise ConfigError(f"AzureConfig.single_put_threshold must be 0..5000 MiB (Azure's "
                              f"largest Put Blob), got {self.single_put_threshold}")
        for name in ("max_concurrency", "max_attempts", "digest_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"AzureConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout_s", "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"AzureConfig.{name} must be > 0 seconds, got "
                                  f"{getattr(self, name)}")
        for name in ("backoff_s", "max_retry_after_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"AzureConfig.{name} must be >= 0 seconds, got "
                                  f"{getattr(self, name)}")


class _Retry(RetryPolicy):
    """azure-core's retry policy with a cap on ``Retry-After`` (see the module docstring)."""

    def __init__(self, config: AzureConfig, throttled: ThrottleCounter | None = None) -> None:
        self._throttled = throttled
        n = config.max_attempts - 1
        super().__init__(retry_total=n, retry_connect=n, retry_read=n, retry_status=n,
                         retry_backoff_factor=config.backoff_s / 2,
                         retry_backoff_max=max(1, int(8 * config.backoff_s)))
        self._cap = config.max_retry_after_s

    def configure_retries(self, options: dict[str, Any]) -> dict[str, Any]:
        # The storage SDK's pipeline leaves these request options for its own retry policy
        # (primary/secondary host selection; tested with azure-storage-blob 12.31), which
        # this one replaces: left in, they would reach the HTTP transport as unknown
        # keywords. Only the primary host is used.
        for name in _STORAGE_RETRY_OPTIONS:
            options.pop(name, None)
        return super().configure_retries(options)

    def send(self, request: PipelineRequest[Any]) -> PipelineResponse[Any, Any]:
        response = super().send(request)
        # ...and reads the host its retry policy chose from every response.
        response.http_response.location_mode = "primary"
        return response

    def sleep(self, settings: dict[str, Any], transport: Any,
              response: PipelineResponse[Any, Any] | None = None) -> None:
        # A 429 or 503 is a throttling refusal: counted, with the wait before the retry.
        refused = (self._throttled is not None and response is not None
                   and response.http_response.status_code in (429, 503))
        if refused:
            assert self._throttled is not None
            self._throttled.refused()
        super().sleep(settings, transport, response)
        if refused:
            assert self._throttled is not None
            self._throttled.sending()

    def get_retry_after(self, response: PipelineResponse[Any, Any]) -> float | None:
        after = super().get_retry_after(response)
        return None if after is None else min(after, self._cap)


def account_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """The blob service the credential chain talks to, as a URL without secrets: the
    connection string's ``BlobEndpoint=``, else one built from its ``AccountName=``
    (``DefaultEndpointsProtocol=``, ``EndpointSuffix=``; ``UseDevelopmentStorage=true``
    is Azurite's default address), else ``https://<AZURE_STORAGE_ACCOUNT_NAME>.blob.core.
    windows.net``; None when neither variable is set. A probe's cache key
    (:func:`tierckpt.tier2.probe.server_identity`): two accounts are two servers."""
    env = os.environ if environ is None else environ
    conn = env.get(CONNECTION_STRING_VAR, "").strip()
    if conn:
        fields = {k.strip().lower(): v.strip() for k, _, v in
                  (part.partition("=") for part in conn.split(";")) if k.strip()}
        if fields.get("usedevelopmentstorage", "").lower() == "true":
            return "http://127.0.0.1:10000/devstoreaccount1"
        if fields.get("blobendpoint"):
            return fields["blobendpoint"].rstrip("/")
        protocol = fields.get("defaultendpointsprotocol", "https")
        suffix = fields.get("endpointsuffix", "core.windows.net")
        return f"{protocol}://{fields.get('accountname', '')}.blob.{suffix}"
    account = env.get(ACCOUNT_VAR, "").strip()
    return f"https://{account}.blob.core.windows.net" if account else None


def make_service_client(config: AzureConfig,
                        throttled: ThrottleCounter | None = None) -> BlobServiceClient:
    """A :class:`BlobServiceClient` from the credential chain (module docstring); no
    request is sent. :class:`ConfigError` names the variables to set when none is, or
    when a value is malformed (without repeating a secret)."""
    kw: dict[str, Any] = {
        "retry_policy": _Retry(config, throttled),
        "connection_timeout": config.connect_timeout_s,
        "read_timeout": config.read_timeout_s,
        # Every put and ranged get is one request of at most these sizes (we split).
        "max_single_put_size": max(config.single_put_threshold, 1),
        "max_block_size": config.block_size,
        "max_single_get_size": config.block_size,
        "max_chunk_get_size": config.block_size,
        "connection_data_block_size": READ_PIECE,
    }
    env = os.environ
    conn = env.get(CONNECTION_STRING_VAR, "").strip()
    if conn:
        try:
            return BlobServiceClient.from_connection_string(conn, **kw)
        except (ValueError, AzureError):
            raise ConfigError(
                f"{CONNECTION_STRING_VAR} is not a valid Azure Storage connection string "
                "(AccountName=...;AccountKey=...;BlobEndpoint=...; copy it from the portal or "
                "`az storage account show-connection-string`)") from None
    account = env.get(ACCOUNT_VAR, "").strip()
    if not account:
        raise ConfigError(
            f"az:// storage needs credentials: set {CONNECTION_STRING_VAR}, or "
            f"{ACCOUNT_VAR} with {KEY_VAR}, or {ACCOUNT_VAR} alone with azure-identity "
            "installed (Azure's default credential chain: managed identity, az login...)")
    if not _ACCOUNT_RE.fullmatch(account):
        raise ConfigError(f"{ACCOUNT_VAR}={account!r} is not a storage account name (3-24 "
                          "lowercase letters and digits)")
    url = f"https://{account}.blob.core.windows.net"
    key = env.get(KEY_VAR, "").strip()
    if key:
        from azure.core.credentials import AzureNamedKeyCredential

        return BlobServiceClient(url, credential=AzureNamedKeyCredential(account, key), **kw)
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise ConfigError(
            f"{ACCOUNT_VAR} is set without {KEY_VAR}, and azure-identity (Azure's default "
            f"credential chain) is not installed: set {KEY_VAR} or "
            f"{CONNECTION_STRING_VAR}, or pip install azure-identity") from None
    return BlobServiceClient(url, credential=DefaultAzureCredential(), **kw)


def open_range(blob: BlobClient, offset: int, length: int, etag: str | None, *,
               direct: bool | None = None) -> tuple[int, Generator[bytes, None, None]]:
    """Send one Get Blob of bytes [offset, offset+length) of ``blob``, with ``If-Match:
    etag`` when given (a blob replaced since is refused, 412, not mixed in); returns ``(the
    bytes the service is sending, the body)``, the body as pieces of at most
    :data:`READ_PIECE` bytes read from the connection as they are iterated. Close the
    iterator if you stop early. The service sends fewer bytes than ``length`` for a range
    that ends past the blob's end, and refuses one that starts past it (416).

    Errors are the SDK's: :class:`HttpResponseError` with the status for a refusal, another
    :class:`AzureError` for a body that broke off or stalled (the caller asks again).

    ``direct`` (default: the SDK release is in :data:`TESTED`) streams the body from the
    SDK's generated Get Blob operation (``BlobClient._client.blob.download``, private):
    the public ``download_blob`` reads each range whole into memory and joins it first, a
    second copy of every byte and a range-sized buffer per worker, which held fetches to
    about half obstore's speed. ``direct=False`` is that public path (same bytes, slower).
    """
    if direct if direct is not None else ".".join(SDK_VERSION.split(".")[:2]) in TESTED:
        ops = blob._client.blob  # the fence: see the docstring
        conditions = {"headers": {"If-Match": etag}} if etag is not None else {}
        sent, body = ops.download(
            range=f"bytes={offset}-{offset + length - 1}", decompress=False,
            cls=lambda _pipeline_response, body, headers: (headers["Content-Length"], body),
            **conditions)
        return length if sent is None else int(sent), _pieces(body)
    dl = blob.download_blob(offset=offset, length=length, max_concurrency=1, etag=etag,
                            match_condition=MatchConditions.IfNotModified) if etag else \
        blob.download_blob(offset=offset, length=length, max_concurrency=1)
    return int(dl.size), _pieces(dl.chunks())


def _pieces(body: Iterator[bytes]) -> Generator[bytes, None, None]:
    """``body``, closing the response under it (azure-core's stream of one) when the
    consumer stops early: its connection is not reused half-read."""
    try:
        yield from body
    finally:
        response = getattr(body, "response", None)
        if response is not None:
            response.internal_response.close()


def error_code(e: Exception) -> str:
    """The service's error code (``BlobNotFound``, ``Md5Mismatch``...), or ``""``: the
    SDK's, else the response's ``x-ms-error-code`` (errors of :func:`open_range`'s direct
    path are azure-core's, which do not parse it)."""
    code = getattr(e, "error_code", None)
    if not code:
        response = getattr(e, "response", None)
        code = response.headers.get("x-ms-error-code") if response is not None else None
    return str(getattr(code, "value", code) or "")


def http_status(e: Exception) -> int:
    return int(getattr(e, "status_code", None) or 0)


def crc_of_metadata(metadata: dict[str, str] | None) -> int | None:
    """The CRC32C tierckpt recorded in a blob's metadata (:data:`META_CRC32C`), or None."""
    value = (metadata or {}).get(META_CRC32C)
    if value is None:
        return None
    try:
        return checksum.from_hex(value)
    except ValueError:
        return None
