"""The storage seam: the :class:`Storage` protocol every tier-2 backend implements.

A backend is an object store rooted at one place (a bucket prefix, a directory, a dict).
Keys are relative to that root, ``/``-separated, and validated by :func:`validate_key`.
Objects are immutable once written as far as tierckpt is concerned: callers never rely on
overwriting, and the commit marker is written with a create-only put.

Errors (all :class:`~tierckpt.errors.StorageError`, so ``OSError`` too)::

    StorageError                        an operation failed after the backend's retries
    ├── ObjectNotFoundError (+FileNotFoundError)   get of a key that does not exist
    ├── ObjectExistsError   (+FileExistsError)     create-only put found different content
    └── BadDigestError      (+IntegrityError)      bytes do not match the CRC32C given/stored

Every method is safe to call from several threads at once. Credentials and endpoints never
appear in messages: ``Storage.url`` is the only description a backend gives of itself.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from tierckpt.errors import (  # re-exported: the storage errors callers catch
    BadDigestError,
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
)

__all__ = [
    "TMP_MARK",
    "BadDigestError",
    "ByteCounter",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "Storage",
    "StorageError",
    "ThrottleCounter",
    "check_range",
    "validate_key",
    "validate_prefix",
]

TMP_MARK = ".tierckpt-tmp."
"""Names containing this are a backend's in-flight temporaries; never valid key parts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectInfo:
    """What a store reports about one object. ``crc32c`` is None when the store did not
    report a full-object CRC32C (e.g. listings, which never carry checksums)."""

    key: str
    size: int
    crc32c: int | None = None


class ByteCounter:
    """A thread-safe running total of bytes (what a backend's gets returned)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._n += n

    @property
    def value(self) -> int:
        with self._lock:
            return self._n


Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``: how far long work over many objects is (a CLI's
progress bar)."""


class ProgressTally:
    """Bytes done of ``total``, each :meth:`add` reported to ``progress`` in order: the
    report is made under the lock, so the bar never goes back. Thread-safe; with no
    ``progress`` it does nothing."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self._lock = threading.Lock()
        self._done, self.total, self._progress = 0, total, progress
        if progress is not None:
            progress(0, total)

    def add(self, n: int) -> None:
        if self._progress is None:
            return
        with self._lock:
            self._done += n
            self._progress(self._done, self.total)


class ThrottleCounter:
    """What a store's throttling cost: the requests it refused for their rate (S3 ``503
    SlowDown``, ``429``) and the seconds spent waiting before each was sent again.

    A backend whose store can throttle exposes one as ``throttled`` (optional: callers use
    ``getattr(storage, "throttled", None)``) and calls :meth:`refused` when a request is
    refused and :meth:`sending` before every request, on the thread that sends it: the
    wait is the time between the two on that thread. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._requests = 0
        self._seconds = 0.0

    def refused(self) -> None:
        with self._lock:
            self._requests += 1
        self._local.since = time.monotonic()

    def sending(self) -> None:
        since = getattr(self._local, "since", None)
        if since is not None:
            self._local.since = None
            with self._lock:
                self._seconds += time.monotonic() - since

    def snapshot(self) -> tuple[int, float]:
        """``(requests refused, seconds waited)`` so far."""
        with self._lock:
            return self._requests, self._seconds


@runtime_checkable
class Storage(Protocol):
    """A narrow object-store interface: whole-object puts and gets, head, list, delete.

    Atomicity, common to every backend: an object is visible under its key only once all
    of its bytes are stored; a reader sees the old object or the new one, never a mix or a
    prefix. There is no atomicity across keys: committing several objects is the caller's
    job (objects, verify, then a marker with a create-only put).
    """

    url: str
    """A description safe to log (``s3://bucket/prefix``, ``file:///dir``): no secrets."""
    @property
    def integrity(self) -> str:
        """How uploads are verified end to end (``crc32c``, or ``md5`` for an S3 server
        without CRC32C support; :class:`tierckpt.tier2.capabilities.IntegrityMode`)."""
        ...

    def put_file(self, key: str, path: str | os.PathLike[str], *, crc32c: int,
                 size: int) -> ObjectInfo:
        """Store the file at ``path`` under ``key``, atomically replacing any old object.

        ``crc32c`` and ``size`` are the values recorded when the file was written (e.g. in
        the manifest). The store checks the bytes it received against them end to end and
        this returns only after the store confirmed both; on a mismatch nothing new is
        visible under ``key`` and :class:`BadDigestError` is raised (after retries, since a
        mismatch can be transient corruption in transit).
        """
        ...

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        """Store ``data`` under ``key`` atomically (checksummed like :meth:`put_file`).

        With ``if_none_match=True`` the put is create-only: if ``key`` already holds
        *different* bytes it raises :class:`ObjectExistsError` and leaves them untouched.
        If it already holds the *same* bytes the put succeeds, so that retrying after a
        lost response (stored, but the client saw an error) is idempotent.
        """
        ...

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        """Download ``key`` to ``path`` (parent created if needed), verified.

        The bytes are checked against ``crc32c`` when given, else against the checksum the
        store reports (if any), before ``path`` appears: it is written to a temporary name,
        fsync'd and renamed, so ``path`` never holds a partial or unverified object.
        Raises :class:`ObjectNotFoundError` or :class:`BadDigestError`.
        """
        ...

    def get_bytes(self, key: str) -> bytes:
        """Whole small object (a manifest, a marker), checked against the store's CRC32C
        when it reports one. Raises :class:`ObjectNotFoundError` or :class:`BadDigestError`."""
        ...

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of ``key`` from ``offset`` (a ranged GET; large ranges
        in parallel parts). Not verified here — no store checksums a range — so the caller
        checks them against its own CRC32C (a manifest chunk). A range past the end of the
        object is a :class:`StorageError`; a missing key :class:`ObjectNotFoundError`."""
        ...

    @property
    def bytes_read(self) -> int:
        """Bytes returned by this backend's gets so far (``get_file``, ``get_bytes``,
        ``get_range``), for reports and for tests that bound what a reader fetched."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """Size and full-object CRC32C of ``key`` as the store reports them now, or None if
        it does not exist. Strongly consistent with completed puts and deletes."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every complete object whose key starts with ``prefix`` (a plain string prefix),
        sorted by key; in-flight uploads and temporaries never appear. ``crc32c`` is None."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key`` atomically (readers see it or nothing). Idempotent: deleting a
        missing key succeeds."""
        ...

    def abort_uploads(self, prefix: str) -> int:
        """Discard unfinished uploads (multipart uploads, temporaries) of keys starting with
        ``prefix`` and return how many. Call it only on prefixes you own, when no upload of
        yours is in flight there (e.g. at uploader start-up after a crash): it cannot tell
        a stale upload from a live one of another writer."""
        ...

    def close(self) -> None:
        """Release clients and pools. Idempotent."""
        ...

    def __enter__(self) -> Storage:
        """A backend is a context manager: ``__exit__`` calls :meth:`close`."""
        ...

    def __exit__(self, *exc: object) -> None:
        ...


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise :class:`ConfigError`.

    Valid: non-empty ``/``-separated parts, none empty, ``.`` or ``..``, no backslash or NUL,
    no part containing the backend temporary mark, at most 1024 bytes.
    """
    if not isinstance(key, str) or not key:
        raise ConfigError(f"object key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8")) > 1024:
        raise ConfigError(f"object key longer than 1024 bytes: {key[:64]!r}...")
    for part in key.split("/"):
        if part in ("", ".", "..") or "\\" in part or "\x00" in part or TMP_MARK in part:
            raise ConfigError(
                f"invalid object key {key!r}: use '/'-separated names without empty, '.', "
                f"'..' parts, backslashes or NUL")
    return key


def check_range(offset: int, length: int) -> None:
    """Refuse a negative offset or length (:class:`ConfigError`)."""
    if offset < 0 or length < 0:
        raise ConfigError(f"byte range needs offset >= 0 and length >= 0, got {offset}+{length}")


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is ``""`` or a key (optionally ending in ``/``), else raise
    :class:`ConfigError`."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix
