"""The tier-2 storage seam: the :class:`Storage` protocol and its backends.

``open_storage(url)`` is the usual entry point. The S3 backend (``tierckpt.storage.s3``)
imports boto3 and is loaded only for ``s3://`` URLs.
"""

from __future__ import annotations

from tierckpt.storage.base import (
    BadDigestError,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    validate_key,
)
from tierckpt.storage.local import LocalStorage
from tierckpt.storage.memory import MemoryStorage
from tierckpt.storage.url import open_storage

__all__ = [
    "BadDigestError",
    "LocalStorage",
    "MemoryStorage",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "Storage",
    "open_storage",
    "validate_key",
]
