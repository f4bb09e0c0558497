"""The tier-2 storage seam: the :class:`Storage` protocol and its backends.

``open_storage(url)`` is the usual entry point. The S3 backend (``tierckpt.tier2.storage.s3``)
imports boto3 and is loaded only for ``s3://`` URLs.
"""

from __future__ import annotations

from tierckpt.tier2.storage.base import (
    BadDigestError,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    validate_key,
)
from tierckpt.tier2.storage.local import LocalStorage
from tierckpt.tier2.storage.memory import MemoryStorage
from tierckpt.tier2.storage.url import open_storage

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
