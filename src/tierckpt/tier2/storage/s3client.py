"""S3 client set-up and reading its responses: :class:`S3Config`, clients from cached
sessions, error codes and checksum headers. Used by :mod:`tierckpt.tier2.storage.s3`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

import boto3
import urllib3.exceptions
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from tierckpt.errors import ConfigError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import IntegrityMode, MarkerMode, UploadMode
from tierckpt.tier2.storage.base import ThrottleCounter

MiB = 1024 * 1024
MIN_PART = 5 * MiB  # S3's minimum size of every part but the last
MAX_PARTS = 10_000  # S3's maximum number of parts of one upload
DIGEST_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch",
                          "XAmzContentChecksumMismatch"})
NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
NOT_SUPPORTED_CODES = frozenset({"NotImplemented", "NotSupported", "XNotImplemented",
                                 "UnsupportedOperation"})
"""Error codes with which S3 servers say "this server does not do that" (mostly HTTP 501)."""
STREAM_ERRORS = (BotoCoreError, urllib3.exceptions.HTTPError, OSError)
ENDPOINT_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
"""The environment variables botocore reads an S3 endpoint from (the S3 one wins)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Config:
    """Transfer, retry and timeout settings of :class:`S3Storage` (sizes in bytes)."""

    part_size: int = 16 * MiB
    """Multipart part size and ranged-GET size; at least 5 MiB (S3's minimum part). Grown
    automatically for objects that would otherwise need more than 10,000 parts."""
    multipart_threshold: int = 16 * MiB
    """Objects larger than this are uploaded in parts, in parallel."""
    max_concurrency: int = 8
    """Parallel parts / ranges per object."""
    max_attempts: int = 5
    """botocore attempts per request (standard retry mode), and our attempts per range."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    """Per socket read/write; a stalled connection fails after this and is retried."""
    digest_attempts: int = 3
    """Attempts of a part, single PUT or download whose bytes failed their checksum."""
    addressing_style: str = "auto"
    """botocore addressing style: auto, path or virtual."""
    integrity: str = IntegrityMode.CRC32C.value
    """How uploads are verified (:class:`~tierckpt.tier2.capabilities.IntegrityMode`):
    ``crc32c`` (full-object CRC32C, the default) or ``md5`` (Content-MD5 and ETag per
    request, CRC32C in metadata); the job's probe picks it per server."""
    marker: str = MarkerMode.CREATE_ONLY.value
    """How create-only puts are made (:class:`~tierckpt.tier2.capabilities.MarkerMode`):
    ``create-only`` (If-None-Match) or ``readback``."""
    upload: str = UploadMode.MULTIPART.value
    """How objects are sent (:class:`~tierckpt.tier2.capabilities.UploadMode`): ``multipart``
    (parts above ``multipart_threshold``; stale uploads swept) or ``single-put`` (one PUT
    per object, at most 5 GiB; nothing to sweep), for a server without multipart upload,
    listing or abort; the job's probe picks it per server."""

    def __post_init__(self) -> None:
        if self.part_size < MIN_PART or self.part_size > 5 * 1024 * MiB:
            raise ConfigError(f"S3Config.part_size must be 5 MiB..5 GiB, got {self.part_size}")
        if self.multipart_threshold < 0:
            raise ConfigError("S3Config.multipart_threshold must be >= 0")
        for name in ("max_concurrency", "max_attempts", "digest_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"S3Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("S3Config timeouts must be > 0 seconds")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError("S3Config.addressing_style must be auto, path or virtual")
        if self.integrity not in {m.value for m in IntegrityMode}:
            raise ConfigError(f"S3Config.integrity must be crc32c or md5, got "
                              f"{self.integrity!r}")
        if self.marker not in {m.value for m in MarkerMode}:
            raise ConfigError(f"S3Config.marker must be create-only or readback, got "
                              f"{self.marker!r}")
        if self.upload not in {m.value for m in UploadMode}:
            raise ConfigError(f"S3Config.upload must be multipart or single-put, got "
                              f"{self.upload!r}")

    def botocore_config(self) -> Config:
        return Config(
            retries={"mode": "standard", "max_attempts": self.max_attempts},
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
            max_pool_connections=max(10, 2 * self.max_concurrency),
            # We send our own CRC32C and verify downloads ourselves; no extra CRC32 pass.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": self.addressing_style},
        )


def error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def http_status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def not_supported(e: ClientError) -> bool:
    """Whether the server answered "I do not implement this" (HTTP 501, or a code in
    :data:`NOT_SUPPORTED_CODES`): a capability answer, not an outage or a refusal."""
    return http_status(e) == 501 or error_code(e) in NOT_SUPPORTED_CODES


META_CRC32C = "tierckpt-crc32c"
"""User-metadata key (``x-amz-meta-tierckpt-crc32c``) of the manifest's CRC32C, hex."""


def crc_of_head(h: dict[str, Any]) -> int | None:
    """The CRC32C a HEAD/GET response vouches for: the store's full-object checksum, else
    the one tierckpt recorded in the object's metadata (md5 integrity mode)."""
    crc = crc_of(h.get("ChecksumCRC32C"))
    if crc is None:
        meta = (h.get("Metadata") or {}).get(META_CRC32C)
        with contextlib.suppress(ValueError, TypeError):
            crc = checksum.from_hex(str(meta)) if meta is not None else None
    return crc


def crc_of(value: object) -> int | None:
    """A full-object CRC32C from a response header (None for composite ``x-N`` values)."""
    if not isinstance(value, str) or "-" in value:
        return None
    try:
        return checksum.from_b64(value)
    except ValueError:
        return None


def endpoint() -> str | None:
    """The S3 endpoint botocore takes from the environment (the S3-specific one wins), or
    None (the AWS default)."""
    for var in reversed(ENDPOINT_VARS):
        if os.environ.get(var):
            return os.environ[var]
    return None


def check_endpoints(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a malformed S3 endpoint in the environment (:data:`ENDPOINT_VARS`) with a
    :class:`ConfigError` naming the variable and the form ``http://host:port``, before
    botocore turns it into a traceback (``localhost:9000``: "Invalid endpoint") or into a
    failure at the first request (``ftp://host``, ``http://host:abc``). Unset or empty
    variables (botocore ignores those), and any with ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``
    true, are not checked."""
    env = os.environ if environ is None else environ
    if env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() == "true":
        return
    for var in ENDPOINT_VARS:
        value = env.get(var, "")
        if not value:
            continue
        try:
            parts = urllib.parse.urlsplit(value)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            _ = parts.port  # ValueError for a port that is not a number in 0..65535
        except ValueError:
            ok = False
        if not ok or value != value.strip():
            raise ConfigError(
                f"{var}={value!r} is not an endpoint URL; set it to http://host:port (or "
                f"https://host), e.g. {var}=http://localhost:9000"
                + ("" if "://" in value else f" (a scheme is missing: http://{value})"))


_SESSIONS: dict[tuple[tuple[str, str], ...], boto3.session.Session] = {}
_SESSIONS_LOCK = threading.Lock()


def make_client(config: S3Config, session: boto3.session.Session | None) -> Any:
    """An S3 client from ``session`` or from a session cached per AWS_* environment (a new
    session re-reads botocore's service models, ~0.2 s; clients from one are cheap).
    Session.client is not thread-safe, hence the lock. A malformed endpoint (environment:
    :func:`check_endpoints`; AWS config file: botocore's ``ValueError``) or region is a
    :class:`ConfigError`."""
    check_endpoints()
    with _SESSIONS_LOCK:
        if session is None:
            # Endpoints are read at client creation; credentials are cached per session.
            env = tuple(sorted((k, v) for k, v in os.environ.items()
                               if k.startswith("AWS_") and not k.startswith("AWS_ENDPOINT_URL")))
            session = _SESSIONS.get(env)
            if session is None:
                session = _SESSIONS[env] = boto3.session.Session()
        try:
            return session.client("s3", region_name=session.region_name or "us-east-1",
                                  config=config.botocore_config())
        except ValueError as e:  # botocore: "Invalid endpoint: ...", InvalidRegionError
            raise ConfigError(
                f"cannot create the S3 client: {e}; check the endpoint (AWS_ENDPOINT_URL, "
                "or endpoint_url in the AWS config: http://host:port) and the region") from None


THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                            "RequestLimitExceeded", "RequestThrottled", "SlowDownRead",
                            "SlowDownWrite"})
"""S3 error codes that mean "too many requests" (botocore's standard retry mode retries
them with a jittered backoff)."""


def count_throttling(client: Any, counter: ThrottleCounter) -> None:
    """Feed ``counter`` from ``client``'s events: a response with a throttling code, HTTP 429
    or 503 (S3's ``SlowDown``) is a refusal, and the next request sent on that thread ends
    its wait."""

    def needs_retry(response: Any = None, **_: Any) -> None:
        if response is None:
            return
        http, parsed = response
        code = str((parsed or {}).get("Error", {}).get("Code", ""))
        if code in THROTTLE_CODES or getattr(http, "status_code", 0) in (429, 503):
            counter.refused()  # a HEAD's 503 has no body, hence no code: S3's SlowDown

    def before_send(**_: Any) -> None:
        counter.sending()

    client.meta.events.register("needs-retry.s3", needs_retry)
    client.meta.events.register("before-send.s3", before_send)
