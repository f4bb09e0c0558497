"""The tier-2 catalogue: the only code that reads tier-2 state or deletes from it.

A tier-2 checkpoint is the objects ``<prefix>/step-XXXXXXXX/<member>`` (the same members
as on tier 1); it exists only once its ``COMPLETE`` object does, and the uploader writes
that last (:mod:`tierckpt.tier2.uploader`). Meanings every caller shares, as on tier 1:
*complete* = a ``COMPLETE`` object is listed (cheap, unverified); *committed* = its marker
and manifest verify (:meth:`Tier2Catalog.read_committed`, the tier-1 size bound). Deleting
goes marker first, so a crash mid-delete never leaves a marker over missing objects.
The upload records of a step live on tier 1 (:class:`tierckpt.tier1.catalog.Tier1Catalog`).
"""

from __future__ import annotations

from tierckpt.errors import IntegrityError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.policy import retention
from tierckpt.tier1.manifests import MANIFEST_LIMIT, SMALL_FILE_LIMIT
from tierckpt.tier2.storage import Storage


class Tier2Catalog:
    """What is in one tier-2 store (a :class:`~tierckpt.tier2.storage.Storage`, whose
    prefix is the job's). Holds no state of its own: every call asks the store."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @staticmethod
    def key(step: int, member: str) -> str:
        """Key of ``member`` of ``step``'s checkpoint (relative to the store's prefix)."""
        return layout.object_key("", step, member)

    def objects(self) -> dict[int, dict[str, int]]:
        """Every checkpoint prefix in one listing: step → {member: size}."""
        by_step: dict[int, dict[str, int]] = {}
        for info in self.storage.list("step-"):
            head, _, tail = info.key.partition("/")
            step = layout.parse_step_dirname(head)
            if step is not None and tail:
                by_step.setdefault(step, {})[tail] = info.size
        return by_step

    def complete_steps(self) -> list[int]:
        """Steps with a ``COMPLETE`` object (unverified), ascending."""
        return sorted(s for s, members in self.objects().items() if layout.COMPLETE in members)

    def _get_small(self, step: int, member: str) -> bytes:
        limit = MANIFEST_LIMIT if member == layout.MANIFEST else SMALL_FILE_LIMIT
        data = self.storage.get_bytes(self.key(step, member))
        if len(data) > limit:
            raise IntegrityError(f"tier-2 {layout.step_dirname(step)}/{member} is larger than "
                                 f"{limit} bytes")
        return data

    def marker(self, step: int) -> bytes | None:
        """The raw ``COMPLETE`` object of ``step``, or None when there is none."""
        if self.storage.head(self.key(step, layout.COMPLETE)) is None:
            return None
        return self._get_small(step, layout.COMPLETE)

    def read_committed(self, step: int) -> mf.Committed:
        """The verified manifest of ``step``'s tier-2 checkpoint (marker digest, signature
        when a key is configured, step). Raises :class:`IntegrityError`,
        :class:`~tierckpt.tier2.storage.ObjectNotFoundError` or another ``StorageError``."""
        marker = self._get_small(step, layout.COMPLETE)
        mbytes = self._get_small(step, layout.MANIFEST)
        return mf.verify_committed(marker, mbytes, step=step,
                                   name=f"tier-2 {layout.step_dirname(step)}")

    def delete(self, step: int) -> None:
        """Delete ``step``'s checkpoint: the marker first, then every other object."""
        self.storage.delete(self.key(step, layout.COMPLETE))
        for info in self.storage.list(f"{layout.step_dirname(step)}/"):
            self.storage.delete(info.key)

    def apply_retention(self, *, keep_last: int, keep_every: int) -> list[int]:
        """Delete what tier-2 retention (:func:`tierckpt.policy.retention.tier2_deletions`)
        no longer keeps; return the deleted steps, oldest first."""
        doomed = retention.tier2_deletions(self.complete_steps(), keep_last=keep_last,
                                           keep_every=keep_every)
        for step in doomed:
            self.delete(step)
        return doomed
