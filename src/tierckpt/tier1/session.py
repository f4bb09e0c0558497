"""The job's hold on its tier-1 root: every domain owner takes the root's lock and clears
the debris of dead saves (collective), and lets go at close. Torch-free: the ranks'
collective is any object with ``rank`` and ``all_gather`` (:class:`Gather`)."""

from __future__ import annotations

from typing import Any, Protocol

from tierckpt.errors import LockError
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.lock import FileLock


class Gather(Protocol):
    """The one collective a tier session needs (``runtime.topology.Comm`` is one)."""

    rank: int

    def all_gather(self, obj: Any) -> list[Any]: ...


class Tier1Session:
    """``open()`` once (collective), ``release()`` at close (idempotent)."""

    def __init__(self, catalog: Tier1Catalog, comm: Gather, *, is_owner: bool) -> None:
        self.catalog, self.comm, self.is_owner = catalog, comm, is_owner
        self._lock: FileLock | None = None

    def open(self, *, file_mode: int) -> None:
        """Owners take the lock and remove stale entries (complete checkpoints are never
        touched); LockError on every rank when any owner's root is held by another job."""
        err = None
        if self.is_owner:
            try:
                self._lock = self.catalog.lock(file_mode)
                self.catalog.clean_stale()
            except LockError as e:
                err = str(e)
        errors = [e for e in self.comm.all_gather(err) if e]
        if errors:
            raise LockError(errors[0])

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
