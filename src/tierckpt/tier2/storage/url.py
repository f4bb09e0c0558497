"""Tier-2 URLs: :func:`parse_url` (pure validation, the one parser) and :func:`open_storage`.

Forms: ``s3://bucket/prefix``, ``gs://bucket/prefix`` (Google Cloud Storage),
``az://container/prefix`` (Azure Blob Storage) or ``file:///absolute/path``. Endpoints,
accounts and credentials are never part of the URL: they come from each cloud's standard
chain (S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles...; GCS: application default
credentials, ``STORAGE_EMULATOR_HOST``; Azure: ``AZURE_STORAGE_CONNECTION_STRING``, or
``AZURE_STORAGE_ACCOUNT_NAME`` with a key or the default credential chain).
``memory://name`` gives a fresh in-memory store (in-process tests and demos only; not
shared, not even between two ``open_storage`` calls). Any of them may end in ``?run=NAME``:
one of several sibling runs sharing the prefix's content
(:mod:`tierckpt.tier2.storage.runs`).

:func:`parse_url` does no I/O and imports nothing heavy, so a configuration
(:class:`tierckpt.ManagerConfig`) can refuse a bad URL when it is constructed, with the same
rules :func:`open_storage` applies when the store is opened.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import urllib.parse
from typing import Any, Literal

from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.base import Storage, validate_key
from tierckpt.tier2.storage.local import LocalStorage
from tierckpt.tier2.storage.memory import MemoryStorage
from tierckpt.tier2.storage.runs import RunStorage, validate_run

FORMS = ("s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or "
         "file:///absolute/path")
"""The URL forms a user should write, for messages."""
_BUCKET_RE = re.compile(r"[A-Za-z0-9._-]+")
_GCS_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_AZ_CONTAINER_RE = re.compile(r"(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")
_OBJECT_STORES = {  # scheme -> (what the location is called, its rule, where credentials go)
    "s3": ("bucket", _BUCKET_RE, "letters, digits, '.', '-' and '_' only",
           "put the endpoint in AWS_ENDPOINT_URL=http://host:port and the credentials in the "
           "AWS environment (AWS_ACCESS_KEY_ID, ...) or config"),
    "gs": ("bucket", _GCS_BUCKET_RE, "3-222 lowercase letters, digits, '.', '-' and '_'",
           "the credentials come from Google's application default credentials and an "
           "emulator's address from STORAGE_EMULATOR_HOST=http://host:port"),
    "az": ("container", _AZ_CONTAINER_RE, "3-63 lowercase letters, digits and single '-'",
           "the account and its credentials come from AZURE_STORAGE_CONNECTION_STRING, or "
           "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_KEY or Azure's default credentials"),
}
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageURL:
    """A tier-2 URL that :func:`parse_url` accepted."""

    scheme: Literal["s3", "gs", "az", "file", "memory"]
    location: str
    """``s3``, ``gs``: the bucket; ``az``: the container; ``file``: the absolute directory
    (percent-decoded); ``memory``: the store's name."""
    prefix: str = ""
    """``s3``, ``gs``, ``az``: the key prefix, without leading or trailing ``/`` (``""``: the
    bucket's root); always ``""`` for the other schemes."""
    run: str = ""
    """The sibling run (``?run=NAME``) whose steps the URL means; ``""``: the prefix's own."""


def parse_url(url: object, *, name: str = "storage URL") -> StorageURL:
    """Validate a tier-2 URL without touching the network or the disk.

    ``name`` is what the caller calls the value (``"tier2"``, ``"--tier2"``): every
    :class:`ConfigError` starts with it and shows the form to write instead. Refused: a
    non-string, surrounding whitespace or control characters, a fragment, a query other
    than ``?run=NAME`` (a valid run name), an unknown scheme, an object-store URL without a
    bucket (container), with credentials or
    with a ``host:port`` where the bucket goes, a bucket name the store cannot have, a
    prefix that is not a valid key, and a ``file:`` URL that is not
    ``file:///absolute/path`` (``file://relative/p`` names a host ``relative``, not a
    relative path).
    """
    if not isinstance(url, str):
        raise ConfigError(f"{name} must be a URL string ({FORMS}), got "
                          f"{type(url).__name__} {url!r}")
    if url != url.strip() or _CONTROL_RE.search(url):
        raise ConfigError(f"{name} must not have surrounding spaces or control characters, "
                          f"got {url!r}; write {FORMS}")
    parts = urllib.parse.urlsplit(url)
    if parts.fragment or url.endswith("#"):
        raise ConfigError(f"{name} must not have a fragment ('#...'), got {url!r}; "
                          f"write {FORMS}")
    if parts.query or url.endswith("?"):
        run = _run(parts.query, url, name)
        base = parse_url(url[:url.index("?")], name=name)
        return dataclasses.replace(base, run=run)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError(
                f"{name} must be an absolute file URL, file:///absolute/path (three slashes), "
                f"got {url!r}" + (f", which names the host {parts.netloc!r}"
                                  if parts.netloc not in ("", "localhost") else ""))
        return StorageURL(scheme="file", location=urllib.parse.unquote(parts.path))
    if parts.scheme == "memory":
        return StorageURL(scheme="memory", location=parts.netloc or "mem")
    if parts.scheme in _OBJECT_STORES:
        return _parse_bucket(url, parts, name)
    raise ConfigError(f"{name}: unsupported URL {url!r}; write {FORMS}")


def _run(query: str, url: str, name: str) -> str:
    """The run a URL's query names: ``run=NAME`` and nothing else."""
    if not query.startswith("run=") or "&" in query:
        raise ConfigError(f"{name}: the only query a tier-2 URL takes is ?run=NAME (one of "
                          f"several runs sharing the prefix), got {url!r}; write {FORMS}, "
                          "with ?run=NAME for a sibling run")
    try:
        return validate_run(urllib.parse.unquote(query.removeprefix("run=")), url=url)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from None


def _parse_bucket(url: str, parts: urllib.parse.SplitResult, name: str) -> StorageURL:
    scheme = parts.scheme
    what, rule, chars, where = _OBJECT_STORES[scheme]
    form = f"{scheme}://{what}/prefix"
    bucket = parts.netloc
    if not bucket:
        raise ConfigError(f"{name}: {url!r} has no {what}; write {form}")
    if "@" in bucket:  # the message does not repeat the URL: it holds a secret
        raise ConfigError(f"{name}: never put credentials or an endpoint in a {scheme}:// "
                          f"URL; write {form}; {where}")
    if ":" in bucket:  # the endpoint's variable, with the host:port given
        raise ConfigError(
            f"{name}: {bucket!r} in {url!r} is a host:port, not a {what} name ({what} names "
            f"cannot contain ':'); write {form}; "
            + where.replace("http://host:port", f"http://{bucket}"))
    if not rule.fullmatch(bucket):
        raise ConfigError(f"{name}: {bucket!r} in {url!r} is not a {what} name ({chars}); "
                          f"write {form}")
    prefix = parts.path.strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except ConfigError as e:
            raise ConfigError(f"{name}: the prefix {prefix!r} of {url!r} is not valid ({e}); "
                              f"write {form}") from None
    return StorageURL(scheme=scheme, location=bucket, prefix=prefix)  # type: ignore[arg-type]


_BACKENDS = {  # scheme -> (module, storage class, config class, what to install)
    "s3": ("tierckpt.tier2.storage.s3", "S3Storage", "S3Config", "boto3: install tierckpt[s3]"),
    "gs": ("tierckpt.tier2.storage.gcs", "GCSStorage", "GCSConfig",
           "google-cloud-storage: install tierckpt[gcs]"),
    "az": ("tierckpt.tier2.storage.azure", "AzureStorage", "AzureConfig",
           "azure-storage-blob: install tierckpt[azure]"),
}


OBJECT_STORES = frozenset(_BACKENDS)
"""The schemes of object stores (``s3``, ``gs``, ``az``): probed, and opened with options."""

CREDENTIAL_ENV = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
           "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"),
    "gs": ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST"),
    "az": ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
           "AZURE_STORAGE_KEY", "AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET"),
}
"""scheme -> the environment variables its credential chain and endpoint are read from
(secrets included: launchers pass them on, never print them). Azure's ``AZURE_CLIENT_*``
and ``AZURE_TENANT_ID`` are the service principal ``DefaultAzureCredential`` reads when
``AZURE_STORAGE_ACCOUNT_NAME`` is set alone. ``GOOGLE_APPLICATION_CREDENTIALS`` names a
key file, which must exist where the job runs."""


def _backend(scheme: str) -> Any:
    """The module of ``scheme``'s backend; ConfigError naming the extra when its client
    library is not installed."""
    module_name, _, _, needs = _BACKENDS[scheme]
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{scheme}:// storage needs {needs}") from e


def option_names(scheme: str) -> frozenset[str]:
    """The options :func:`open_storage` accepts for ``scheme``: the fields of its object
    store's config (``S3Config``, ``GCSConfig``, ``AzureConfig``); none for ``file`` and
    ``memory``. Imports the store's client library."""
    if scheme not in _BACKENDS:
        return frozenset()
    config = getattr(_backend(scheme), _BACKENDS[scheme][2])
    return frozenset(f.name for f in dataclasses.fields(config))


def open_storage(url: str, **options: object) -> Storage:
    """Return the backend for ``url`` (validated by :func:`parse_url`); ``options`` become
    the object store's config (:class:`~tierckpt.tier2.storage.s3.S3Config` for ``s3://``,
    ``GCSConfig`` for ``gs://``, ``AzureConfig`` for ``az://``; e.g. ``part_size=...``).

    Raises :class:`ConfigError` naming what to fix for a URL :func:`parse_url` refuses, a
    ``file://`` directory that does not exist (it is never created: an unmounted file
    system must not be mistaken for tier 2), options for a ``file://`` or ``memory://`` URL
    or unknown to the store's config, a malformed endpoint, or a store whose client library
    is not installed.
    """
    u = parse_url(url)
    if u.run:
        return RunStorage(open_storage(url[:url.index("?")], **options), u.run)
    if u.scheme not in _BACKENDS and options:
        raise ConfigError(f"object-store options were given for a {u.scheme}:// URL")
    if u.scheme == "file":
        return LocalStorage(u.location)
    if u.scheme == "memory":
        return MemoryStorage(u.location)
    _, storage_name, config_name, _ = _BACKENDS[u.scheme]
    module = _backend(u.scheme)
    try:
        config = getattr(module, config_name)(**options)
    except TypeError as e:
        raise ConfigError(f"unknown {u.scheme}:// storage option: {e}") from e
    storage: Storage = getattr(module, storage_name)(u.location, u.prefix, config=config)
    return storage
