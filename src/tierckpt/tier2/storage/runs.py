"""Sibling runs under one tier-2 prefix: ``<url>?run=NAME`` (issue 41).

Runs fine-tuned from one base share most of their bytes. Under one prefix, each run's steps
live under ``runs/<NAME>/`` and the content objects (``objects/…``: the bytes, and the
sweeps' leases) stay at the prefix, shared by every run::

    <prefix>/
      objects/sha256/<hex>          content, shared by every run's steps
      objects/sweeps/<id>.json      the leases of deletions in progress (every run's)
      step-00000100/                the steps of the run opened without ?run= (if any)
      runs/lora-a/step-00000100/    run "lora-a": its map, manifest, COMPLETE
      runs/lora-b/step-00000040/    run "lora-b"

:class:`RunStorage` is the prefix seen by one run: keys under ``objects/`` go to the shared
prefix unchanged, every other key under ``runs/<NAME>/``, so the catalogue, the uploader and
every reader work on a run as on a prefix of its own; a run's retention lists and deletes its
own steps only. What a sweep may delete is decided from every run's maps
(:func:`tierckpt.tier2.sweep.references`), so two runs never delete each other's objects.
"""

from __future__ import annotations

import dataclasses
import os
import re

from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.base import ObjectInfo, Storage, ThrottleCounter

RUNS = "runs/"
"""Where the named runs' steps live under a shared prefix."""
SHARED = "objects/"
"""Keys under this stay at the shared prefix (:data:`tierckpt.format.objmap.OBJECTS`'s
parent: content and leases)."""
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_run(name: str, *, url: str = "") -> str:
    """Return ``name`` if it can name a run (1-64 letters, digits, ``.``, ``_``, ``-``,
    starting with a letter or digit), else a :class:`ConfigError` saying what to write."""
    if not _NAME_RE.fullmatch(name):
        raise ConfigError(f"run name {name!r}{f' in {url!r}' if url else ''} must be 1-64 "
                          "letters, digits, '.', '_' or '-', starting with a letter or "
                          "digit; write e.g. s3://bucket/prefix?run=lora-a")
    return name


class RunStorage:
    """The store ``base`` (a shared prefix) as run ``run`` sees it (module docstring).
    ``shared`` is ``base``: what a sweep lists every run's maps from."""

    def __init__(self, base: Storage, run: str) -> None:
        self.shared, self.run = base, validate_run(run)
        self._prefix = f"{RUNS}{run}/"
        self.url = f"{base.url}?run={run}"

    def _key(self, key: str) -> str:
        return key if key.startswith(SHARED) else self._prefix + key

    def _info(self, info: ObjectInfo) -> ObjectInfo:
        return dataclasses.replace(info, key=info.key.removeprefix(self._prefix))

    @property
    def integrity(self) -> str:
        return self.shared.integrity

    @property
    def bytes_read(self) -> int:
        return self.shared.bytes_read

    @property
    def throttled(self) -> ThrottleCounter | None:
        """The shared store's throttling counter, when it has one."""
        return getattr(self.shared, "throttled", None)

    def put_file(self, key: str, path: str | os.PathLike[str], *, crc32c: int,
                 size: int) -> ObjectInfo:
        return self._info(self.shared.put_file(self._key(key), path, crc32c=crc32c,
                                               size=size))

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        return self._info(self.shared.put_bytes(self._key(key), data,
                                                if_none_match=if_none_match))

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        return self._info(self.shared.get_file(self._key(key), path, crc32c=crc32c))

    def get_bytes(self, key: str) -> bytes:
        return self.shared.get_bytes(self._key(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.shared.get_range(self._key(key), offset, length)

    def head(self, key: str) -> ObjectInfo | None:
        info = self.shared.head(self._key(key))
        return None if info is None else self._info(info)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """This run's keys under ``prefix``; with a prefix that can hold shared keys
        (``""``, ``objects/…``) the shared content too."""
        own = [self._info(i) for i in self.shared.list(self._prefix + prefix)]
        if SHARED.startswith(prefix) or prefix.startswith(SHARED):
            own += self.shared.list(prefix if prefix.startswith(SHARED) else SHARED)
        return sorted(own, key=lambda i: i.key)

    def delete(self, key: str) -> None:
        self.shared.delete(self._key(key))

    def abort_uploads(self, prefix: str) -> int:
        return self.shared.abort_uploads(self._key(prefix))

    def close(self) -> None:
        self.shared.close()

    def __enter__(self) -> RunStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
