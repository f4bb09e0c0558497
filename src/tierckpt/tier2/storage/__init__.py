"""The tier-2 storage seam: the :class:`Storage` protocol and its backends.

``open_storage(url)`` is the usual entry point. Each object store's backend is loaded only
for its own URLs, with its client library: S3 (``tierckpt.tier2.storage.s3``, boto3) for
``s3://``, GCS (``tierckpt.tier2.storage.gcs``, google-cloud-storage) for ``gs://``, Azure
(``tierckpt.tier2.storage.azure``, azure-storage-blob) for ``az://``.
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
