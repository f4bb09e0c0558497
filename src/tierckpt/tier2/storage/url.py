"""Open a tier-2 store from its URL: ``s3://bucket/prefix`` or ``file:///path``.

S3 endpoint, region and credentials are never part of the URL: they come from the standard
AWS environment/config chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles...).
``memory://name`` gives a fresh in-memory store (tests and demos only; not shared).
"""

from __future__ import annotations

import urllib.parse

from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.base import Storage
from tierckpt.tier2.storage.local import LocalStorage
from tierckpt.tier2.storage.memory import MemoryStorage


def open_storage(url: str, **s3_options: object) -> Storage:
    """Return the backend for ``url``; ``s3_options`` become an
    :class:`~tierckpt.tier2.storage.s3.S3Config` (e.g. ``part_size=...``) for ``s3://`` URLs.

    Raises :class:`ConfigError` naming what to fix for an unknown scheme, a URL with a
    host or credentials where none belong, or S3 without boto3 installed.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigError(f"storage URL must not have a query or fragment: {url!r}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL must be file:///absolute/path, got {url!r}")
        if not parts.path.startswith("/"):
            raise ConfigError(f"file URL needs an absolute path, got {url!r}")
        if s3_options:
            raise ConfigError("S3 options were given for a file:// URL")
        return LocalStorage(urllib.parse.unquote(parts.path))
    if parts.scheme == "memory":
        return MemoryStorage(parts.netloc or "mem")
    if parts.scheme == "s3":
        if "@" in parts.netloc or ":" in parts.netloc or not parts.netloc:
            raise ConfigError(
                "S3 URL must be s3://bucket/prefix; put the endpoint in AWS_ENDPOINT_URL and "
                "credentials in the AWS environment or config, never in the URL")
        try:
            from tierckpt.tier2.storage.s3 import S3Config, S3Storage
        except ImportError as e:
            raise ConfigError("s3:// storage needs boto3: install tierckpt[s3]") from e
        try:
            config = S3Config(**s3_options)  # type: ignore[arg-type]
        except TypeError as e:
            raise ConfigError(f"unknown S3 option: {e}") from e
        return S3Storage(parts.netloc, parts.path.strip("/"), config=config)
    raise ConfigError(f"unsupported storage URL {url!r}: use s3://bucket/prefix or "
                      f"file:///absolute/path")
