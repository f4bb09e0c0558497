"""Tier-2 URLs: :func:`parse_url` (pure validation, the one parser) and :func:`open_storage`.

Forms: ``s3://bucket/prefix`` or ``file:///absolute/path``. S3 endpoint, region and
credentials are never part of the URL: they come from the standard AWS environment/config
chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles...). ``memory://name`` gives a
fresh in-memory store (in-process tests and demos only; not shared, not even between two
``open_storage`` calls).

:func:`parse_url` does no I/O and imports nothing heavy, so a configuration
(:class:`tierckpt.ManagerConfig`) can refuse a bad URL when it is constructed, with the same
rules :func:`open_storage` applies when the store is opened.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from typing import Literal

from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.base import Storage, validate_key
from tierckpt.tier2.storage.local import LocalStorage
from tierckpt.tier2.storage.memory import MemoryStorage

FORMS = "s3://bucket/prefix or file:///absolute/path"
"""The URL forms a user should write, for messages."""
_BUCKET_RE = re.compile(r"[A-Za-z0-9._-]+")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageURL:
    """A tier-2 URL that :func:`parse_url` accepted."""

    scheme: Literal["s3", "file", "memory"]
    location: str
    """``s3``: the bucket; ``file``: the absolute directory (percent-decoded); ``memory``:
    the store's name."""
    prefix: str = ""
    """``s3``: the key prefix, without leading or trailing ``/`` (``""``: the bucket's
    root); always ``""`` for the other schemes."""


def parse_url(url: object, *, name: str = "storage URL") -> StorageURL:
    """Validate a tier-2 URL without touching the network or the disk.

    ``name`` is what the caller calls the value (``"tier2"``, ``"--tier2"``): every
    :class:`ConfigError` starts with it and shows the form to write instead. Refused: a
    non-string, surrounding whitespace or control characters, a query or fragment, an
    unknown scheme, ``s3://`` without a bucket, with credentials or with a ``host:port``
    where the bucket goes, a bucket name S3 cannot have, a prefix that is not a valid key,
    and a ``file:`` URL that is not ``file:///absolute/path`` (``file://relative/p`` names a
    host ``relative``, not a relative path).
    """
    if not isinstance(url, str):
        raise ConfigError(f"{name} must be a URL string ({FORMS}), got "
                          f"{type(url).__name__} {url!r}")
    if url != url.strip() or _CONTROL_RE.search(url):
        raise ConfigError(f"{name} must not have surrounding spaces or control characters, "
                          f"got {url!r}; write {FORMS}")
    parts = urllib.parse.urlsplit(url)
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConfigError(f"{name} must not have a query or fragment ('?...', '#...'), got "
                          f"{url!r}; write {FORMS}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError(
                f"{name} must be an absolute file URL, file:///absolute/path (three slashes), "
                f"got {url!r}" + (f", which names the host {parts.netloc!r}"
                                  if parts.netloc not in ("", "localhost") else ""))
        return StorageURL(scheme="file", location=urllib.parse.unquote(parts.path))
    if parts.scheme == "memory":
        return StorageURL(scheme="memory", location=parts.netloc or "mem")
    if parts.scheme == "s3":
        return _parse_s3(url, parts, name)
    raise ConfigError(f"{name}: unsupported URL {url!r}; write {FORMS}")


def _parse_s3(url: str, parts: urllib.parse.SplitResult, name: str) -> StorageURL:
    bucket = parts.netloc
    if not bucket:
        raise ConfigError(f"{name}: {url!r} has no bucket; write s3://bucket/prefix")
    if "@" in bucket:  # the message does not repeat the URL: it holds a secret
        raise ConfigError(f"{name}: never put credentials or an endpoint in an s3:// URL; "
                          "write s3://bucket/prefix, put the endpoint in "
                          "AWS_ENDPOINT_URL=http://host:port and the credentials in the AWS "
                          "environment (AWS_ACCESS_KEY_ID, ...) or config")
    if ":" in bucket:
        raise ConfigError(
            f"{name}: {bucket!r} in {url!r} is a host:port, not a bucket name (bucket names "
            f"cannot contain ':'); write s3://bucket/prefix and put the endpoint in "
            f"AWS_ENDPOINT_URL=http://{bucket}")
    if not _BUCKET_RE.fullmatch(bucket):
        raise ConfigError(f"{name}: {bucket!r} in {url!r} is not a bucket name (letters, "
                          "digits, '.', '-' and '_' only); write s3://bucket/prefix")
    prefix = parts.path.strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except ConfigError as e:
            raise ConfigError(f"{name}: the prefix {prefix!r} of {url!r} is not valid ({e}); "
                              "write s3://bucket/prefix") from None
    return StorageURL(scheme="s3", location=bucket, prefix=prefix)


def open_storage(url: str, **s3_options: object) -> Storage:
    """Return the backend for ``url`` (validated by :func:`parse_url`); ``s3_options``
    become an :class:`~tierckpt.tier2.storage.s3.S3Config` (e.g. ``part_size=...``) for
    ``s3://`` URLs.

    Raises :class:`ConfigError` naming what to fix for a URL :func:`parse_url` refuses, a
    ``file://`` directory that does not exist (it is never created: an unmounted file
    system must not be mistaken for tier 2), S3 options for another scheme, a malformed
    ``AWS_ENDPOINT_URL``, or S3 without boto3 installed.
    """
    u = parse_url(url)
    if u.scheme != "s3" and s3_options:
        raise ConfigError(f"S3 options were given for a {u.scheme}:// URL")
    if u.scheme == "file":
        return LocalStorage(u.location)
    if u.scheme == "memory":
        return MemoryStorage(u.location)
    try:
        from tierckpt.tier2.storage.s3 import S3Config, S3Storage
    except ImportError as e:
        raise ConfigError("s3:// storage needs boto3: install tierckpt[s3]") from e
    try:
        config = S3Config(**s3_options)  # type: ignore[arg-type]
    except TypeError as e:
        raise ConfigError(f"unknown S3 option: {e}") from e
    return S3Storage(u.location, u.prefix, config=config)
