"""The tier-2 catalogue: the only code that reads tier-2 state or deletes from it.

A tier-2 checkpoint is ``<prefix>/step-XXXXXXXX/`` with ``manifest.json`` and ``COMPLETE``
(the tier-1 ones, byte for byte) and its files in one of two layouts
(:mod:`tierckpt.format.objmap`): layout 2 (content-addressed, written since issue 41) has a
map ``objects.json`` and keeps each file once under ``objects/sha256/<hex>``, shared by
every step with the same bytes; layout 1 keeps each member under the step prefix. Readers
never guess: :meth:`Tier2Catalog.resolve` gives each member's key, through the map when the
step has one. It exists only once its ``COMPLETE`` object does, and the uploader writes
that last (:mod:`tierckpt.tier2.uploader`). Meanings every caller shares, as on tier 1:
*complete* = a ``COMPLETE`` object is listed (cheap, unverified); *committed* = its marker
and manifest verify (:meth:`Tier2Catalog.read_committed`, the tier-1 size bound). Deleting
goes marker first, then the step's own objects, then the content objects nothing references
any more (:mod:`tierckpt.tier2.sweep`: safe against a kill at any point and against an
upload in flight). The upload records of a step live on tier 1
(:class:`tierckpt.tier1.catalog.Tier1Catalog`).
"""

from __future__ import annotations

from typing import NamedTuple

from tierckpt.errors import IntegrityError
from tierckpt.format import layout, objmap
from tierckpt.format import manifest as mf
from tierckpt.policy import retention
from tierckpt.tier1.manifests import MANIFEST_LIMIT, SMALL_FILE_LIMIT
from tierckpt.tier2 import sweep as sw
from tierckpt.tier2.storage import ObjectNotFoundError, Storage


class Resolved(NamedTuple):
    """A committed tier-2 step and where its members are: ``objmap`` is its verified map
    (None: layout 1, every member under the step prefix)."""

    committed: mf.Committed
    objmap: objmap.ObjectMap | None

    def key(self, member: str) -> str:
        """The key of ``member``'s bytes (KeyError: not a file of this step)."""
        step = self.committed.manifest.step
        if self.objmap is None:
            self.committed.manifest.file(member)
            return Tier2Catalog.key(step, member)
        return self.objmap.keys()[member]


class Tier2Catalog:
    """What is in one tier-2 store (a :class:`~tierckpt.tier2.storage.Storage`, whose
    prefix is the job's). Holds no state of its own: every call asks the store."""

    def __init__(self, storage: Storage, *, sweep_window_s: float = sw.SWEEP_WINDOW_S) -> None:
        """``sweep_window_s``: how long after its lease a sweep may delete, and so how long
        an uploader waits on a lease (:mod:`tierckpt.tier2.sweep`)."""
        self.storage = storage
        self.sweep_window_s = sweep_window_s

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

    def resolve(self, step: int) -> Resolved:
        """:meth:`read_committed` plus where each member is: through the step's map,
        checked against the manifest (:meth:`tierckpt.format.objmap.ObjectMap.check`; signed
        when a key is configured), else layout 1. Raises as :meth:`read_committed`."""
        committed = self.read_committed(step)
        try:
            data = self._get_small(step, objmap.MAP)
        except ObjectNotFoundError:
            return Resolved(committed, None)
        m = objmap.ObjectMap.from_bytes(data, mf.signing_key())
        m.check(committed.manifest, committed.manifest_bytes)
        return Resolved(committed, m)

    def delete(self, step: int, *, sweep: bool = True) -> sw.SweepResult | None:
        """Delete ``step``'s checkpoint: the marker first, then every other object under its
        prefix, then (``sweep``) the content objects no step references any more."""
        self.storage.delete(self.key(step, layout.COMPLETE))
        for info in self.storage.list(f"{layout.step_dirname(step)}/"):
            self.storage.delete(info.key)
        return self.sweep() if sweep else None

    def sweep(self) -> sw.SweepResult:
        """Delete the content objects no complete step's map and no upload in flight
        references (:func:`tierckpt.tier2.sweep.sweep`)."""
        return sw.sweep(self.storage, self.objects, window_s=self.sweep_window_s)

    def content(self) -> dict[str, int]:
        """Every content object in one listing: key → size."""
        return {i.key: i.size for i in self.storage.list(objmap.OBJECTS)}

    def write_part(self, step: int, part: objmap.ObjectMap, tag: str) -> None:
        """Write an uploader's map part (its intent: protects its objects from sweeps)."""
        self.storage.put_bytes(self.key(step, objmap.part_name(tag)),
                               part.to_bytes(mf.signing_key()))

    def parts(self, step: int) -> list[objmap.ObjectMap]:
        """Every uploader's map part of ``step`` (their own digests checked)."""
        prefix = f"{layout.step_dirname(step)}/"
        return [sw.read_map(self.storage, i.key) for i in self.storage.list(prefix)
                if objmap.is_part(i.key[len(prefix):])]

    def drop_parts(self, step: int, tags: list[str] | None = None) -> None:
        """Remove ``step``'s map parts (once its marker and merged map protect its objects):
        those of ``tags`` (no listing), else every one listed."""
        if tags is not None:
            for tag in tags:
                self.storage.delete(self.key(step, objmap.part_name(tag)))
            return
        prefix = f"{layout.step_dirname(step)}/"
        for i in self.storage.list(prefix):
            if objmap.is_part(i.key[len(prefix):]):
                self.storage.delete(i.key)

    def await_sweeps(self) -> None:
        """Wait until no sweep that may have missed this caller's intent still deletes
        (:func:`tierckpt.tier2.sweep.await_sweeps`)."""
        sw.await_sweeps(self.storage, window_s=self.sweep_window_s)

    def apply_retention(self, *, keep_last: int, keep_every: int) -> list[int]:
        """Delete what tier-2 retention (:func:`tierckpt.policy.retention.tier2_deletions`)
        no longer keeps; return the deleted steps, oldest first."""
        doomed = retention.tier2_deletions(self.complete_steps(), keep_last=keep_last,
                                           keep_every=keep_every)
        for step in doomed:
            self.delete(step, sweep=False)
        if doomed:
            self.sweep()
        return doomed
