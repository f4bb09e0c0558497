"""Google Cloud Storage client set-up, retries and errors: :class:`GCSConfig`,
:func:`make_client`, :func:`call` (bounded retries that honour ``Retry-After``) and
:func:`convert` (SDK errors to :class:`~tierckpt.errors.StorageError`). Used by
:mod:`tierckpt.tier2.storage.gcs`.

Credentials: with ``STORAGE_EMULATOR_HOST=http://host:port`` set, anonymous credentials
against that endpoint (what the SDK does for emulators); otherwise Google's application
default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth
application-default login``, the metadata server on GCP). Neither is a
:class:`~tierckpt.errors.ConfigError` that says what to set; no message ever carries a
credential or the endpoint.

Tested with google-cloud-storage 3.17.1 (google-auth 2.63, google-api-core 2.44). The one
private name of the SDK used here is ``Client(_http=...)``, to give the client a connection
pool as large as the parallel parts (the SDK's default pool holds 10 connections).
"""

from __future__ import annotations

import dataclasses
import email.utils
import os
import random
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import google.auth
import google.auth.exceptions
import requests
import requests.adapters
import urllib3.exceptions
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import IntegrityMode
from tierckpt.tier2.storage.base import BadDigestError, ObjectNotFoundError, ThrottleCounter

T = TypeVar("T")
MiB = 1024 * 1024
MAX_COMPOSE = 32
"""GCS composes at most 32 source objects in one request."""
MAX_COMPONENTS = 1024
"""GCS's limit of components in one composite object: the part size grows to stay below."""
EMULATOR_VAR = "STORAGE_EMULATOR_HOST"
PUBLIC_ENDPOINT = "https://storage.googleapis.com"
"""Where the SDK sends requests when no emulator is set."""
TRANSIENT_CODES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses retried (timeouts, throttling, server errors), as Google's guidance says."""
NETWORK_ERRORS = (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                  requests.exceptions.ChunkedEncodingError, urllib3.exceptions.HTTPError,
                  google.auth.exceptions.TransportError, ConnectionError)
"""No answer, a dropped connection or a body that broke off: retried like a 503."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GCSConfig:
    """Transfer, retry and timeout settings of :class:`~tierckpt.tier2.storage.gcs.GCSStorage`
    (sizes in bytes, times in seconds)."""

    part_size: int = 32 * MiB
    """Size of the parts a large file is uploaded in (composed into the object afterwards)
    and of the ranges downloads fetch in parallel; at least 256 KiB. Grown in whole MiB for
    a file that would otherwise need more than 1024 parts (GCS's component limit). Each
    part in flight is held in memory: up to ``max_concurrency * part_size`` per upload."""
    single_upload_threshold: int = 64 * MiB
    """Files up to this size go in one upload request (integrity ``crc32c``); larger ones in
    parallel parts composed into the object. On loopback one stream was faster (64 MiB: one
    request 0.26 s, 8 parts over 4 threads then compose 0.81 s on the emulator, which copies
    bytes to compose); on GCS one stream's throughput is bounded and compose copies nothing,
    so large shards go in parts (``gcloud storage`` does the same above 150 MiB). A file
    sent in one request is read into memory first (it is re-sent from there on a retry)."""
    max_concurrency: int = 8
    """Parallel parts / ranges per object."""
    max_attempts: int = 5
    """Attempts per request on a transient error (429, 5xx, timeouts, dropped connections)."""
    max_backoff_s: float = 30.0
    """Longest wait between attempts, a server's ``Retry-After`` included (it is honoured up
    to this bound; without one the wait starts at 0.1 s and doubles, with jitter)."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    """Per socket read; a stalled connection fails after this and is retried."""
    digest_attempts: int = 3
    """Attempts of an upload the server rejected or stored wrongly (a checksum mismatch can
    be corruption in transit), and of a download whose bytes failed their CRC32C."""
    integrity: str = IntegrityMode.CRC32C.value
    """``crc32c`` (GCS): every upload declares the CRC32C and the server refuses bytes that do
    not match it, so a wrong object never appears. ``md5`` (a server that ignores declared
    checksums, e.g. fake-gcs-server 1.54; the job's probe picks it): every upload goes to a
    temporary name first, and the MD5 and CRC32C the server computed over what it stored
    must equal ours before it is composed into its key."""

    def __post_init__(self) -> None:
        if self.part_size < 256 * 1024 or self.part_size > 5 * 1024 * MiB:
            raise ConfigError(f"GCSConfig.part_size must be 256 KiB..5 GiB, got "
                              f"{self.part_size}")
        if self.single_upload_threshold < 0:
            raise ConfigError(f"GCSConfig.single_upload_threshold must be >= 0, got "
                              f"{self.single_upload_threshold}")
        for name in ("max_concurrency", "max_attempts", "digest_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GCSConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout_s", "read_timeout_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"GCSConfig.{name} must be > 0 seconds, got "
                                  f"{getattr(self, name)}")
        if self.integrity not in {m.value for m in IntegrityMode}:
            raise ConfigError(f"GCSConfig.integrity must be crc32c or md5, got "
                              f"{self.integrity!r}")

    @property
    def timeout(self) -> tuple[float, float]:
        """``(connect, read)`` for every SDK call."""
        return (self.connect_timeout_s, self.read_timeout_s)


def emulator_host(environ: Mapping[str, str] | None = None) -> str | None:
    """The emulator endpoint from ``STORAGE_EMULATOR_HOST`` (None if unset or empty), or a
    :class:`ConfigError` naming the variable and the form ``http://host:port`` when it is
    not an http(s) URL with a host (the SDK would fail at the first request)."""
    value = (os.environ if environ is None else environ).get(EMULATOR_VAR, "")
    if not value:
        return None
    try:
        parts = urllib.parse.urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError:
        ok = False
    if not ok or value != value.strip():
        raise ConfigError(
            f"{EMULATOR_VAR}={value!r} is not an endpoint URL; set it to http://host:port, "
            f"e.g. {EMULATOR_VAR}=http://127.0.0.1:4443"
            + ("" if "://" in value else f" (a scheme is missing: http://{value})"))
    return value


def make_client(config: GCSConfig) -> storage.Client:
    """A storage client: anonymous against ``STORAGE_EMULATOR_HOST`` when it is set, else
    with Google's application default credentials (:class:`ConfigError` when there are
    none). Its connection pool holds ``2 * max_concurrency`` connections (at least 10)."""
    pool = max(10, 2 * config.max_concurrency)
    adapter = requests.adapters.HTTPAdapter(pool_connections=pool, pool_maxsize=pool,
                                            max_retries=0)
    if emulator_host() is not None:
        credentials: Any = AnonymousCredentials()
        project: str | None = "tierckpt"
        session: requests.Session = requests.Session()
    else:
        try:
            credentials, project = google.auth.default(
                scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
        except google.auth.exceptions.DefaultCredentialsError:
            raise ConfigError(
                "gs:// storage found no Google credentials: run `gcloud auth "
                "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a service "
                "account key file, or run on GCP with a service account; for an emulator set "
                f"{EMULATOR_VAR}=http://host:port") from None
        session = AuthorizedSession(credentials)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return storage.Client(project=project, credentials=credentials, _http=session)


def retry_after(e: BaseException) -> float | None:
    """Seconds a throttled server asked us to wait (``Retry-After``: seconds or an HTTP
    date), or None."""
    response = getattr(e, "response", None)
    value = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def transient(e: BaseException) -> bool:
    """Whether ``e`` is worth another attempt (see :data:`TRANSIENT_CODES`)."""
    if isinstance(e, gexc.GoogleAPICallError):
        return e.code in TRANSIENT_CODES
    return isinstance(e, NETWORK_ERRORS)


def call(config: GCSConfig, fn: Callable[[], T],
         throttled: ThrottleCounter | None = None) -> T:
    """``fn()``, again after a transient error, up to ``config.max_attempts`` times; waits
    ``Retry-After`` when the server sent one (at most ``max_backoff_s``), else backs off
    exponentially with jitter. The last error is raised as it came (see :func:`convert`).
    A 429 or 503 is a throttling refusal, counted in ``throttled`` with the wait after it."""
    for attempt in range(config.max_attempts):
        if throttled is not None:
            throttled.sending()
        try:
            return fn()
        except (gexc.GoogleAPICallError, *NETWORK_ERRORS) as e:
            if throttled is not None and getattr(e, "code", None) in (429, 503):
                throttled.refused()
            if not transient(e) or attempt + 1 >= config.max_attempts:
                raise
            asked = retry_after(e)
            wait = asked if asked is not None else 0.1 * 2**attempt * (0.5 + random.random())
            time.sleep(min(wait, config.max_backoff_s))
    raise AssertionError("unreachable")


def convert(where: str, e: BaseException) -> StorageError:
    """A :class:`StorageError` for SDK error ``e`` (404: :class:`ObjectNotFoundError`; a
    server that refused a declared checksum: :class:`BadDigestError`). ``where`` is "op
    gs://bucket/prefix/key"; the message adds only the HTTP status and the error's reason,
    never the endpoint (the SDK's own text names it) or a credential."""
    if isinstance(e, gexc.NotFound):
        return ObjectNotFoundError(f"{where}: no such object")
    if isinstance(e, gexc.GoogleAPICallError):
        reason = e.reason or type(e).__name__
        if e.code == 400 and _names_checksum(e):
            return BadDigestError(f"{where}: the server rejected the bytes (their checksum "
                                  "does not match the declared one)")
        return StorageError(f"{where}: {reason} (HTTP {e.code})")
    return StorageError(f"{where}: {type(e).__name__} after retries")


def _names_checksum(e: gexc.GoogleAPICallError) -> bool:
    text = str(getattr(e, "message", "")).lower()
    return any(w in text for w in ("crc32c", "md5", "checksum", "hash"))


def crc_of(value: object) -> int | None:
    """A CRC32C from an object resource's base64 ``crc32c`` field, or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return checksum.from_b64(value)
    except ValueError:
        return None
