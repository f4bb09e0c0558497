"""Garbage collection of both tiers outside a running job: what ``tierckpt gc`` does.

:func:`plan_gc` is pure: from the steps on each tier, the pins and the uploader's progress
it decides what retention would delete, using :mod:`tierckpt.policy.retention`, so it inherits
its guarantees: the newest complete checkpoint of a tier is never deleted, nor a pinned
one, nor a tier-1 checkpoint the uploader still has to copy (when the root has an
uploader: ``<tier1>/upload-state/`` exists, or a tier 2 is given).

:func:`collect` does it: it takes the tier-1 root lock (``<tier1>/.lock``, the one a live
job holds for its lifetime, so gc can never race a job's saves or retention; a held lock
raises :class:`~tierckpt.errors.LockError`), reads both tiers, plans, and, only with
``apply=True``, deletes: tier-1 checkpoints by rename-then-remove
(:func:`tierckpt.tier1.commit.delete_checkpoint`), leftover tmp/half-deleted directories of
crashed saves (:func:`tierckpt.tier1.commit.clean_stale`), and tier-2 checkpoints marker first
(:func:`tierckpt.tier2.uploader.delete_remote`). Directories without a marker under a final name
and quarantined checkpoints are never touched: they are evidence, for a person to look at.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.ops.inventory import tier1_pins
from tierckpt.policy import retention
from tierckpt.runtime.topology import RootLock
from tierckpt.tier1 import commit
from tierckpt.tier1.commit import complete_steps
from tierckpt.tier2.storage import Storage
from tierckpt.tier2.uploader import delete_remote, remote_complete_steps, uploaded_steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class GcPolicy:
    """Retention to apply: the same knobs as :class:`tierckpt.ManagerConfig`."""

    keep_last: int = 3
    """Tier 1: newest complete checkpoints kept (pinned ones are kept in addition)."""
    upload_every: int = 1
    """The uploader's policy: every Nth step is due for tier 2 (kept on tier 1 until copied)."""
    tier2_keep_last: int = 3
    """Tier 2: newest complete checkpoints kept."""
    tier2_keep_every: int = 0
    """Tier 2: multiples of this step are kept forever (0: none)."""

    def __post_init__(self) -> None:
        for name in ("keep_last", "upload_every", "tier2_keep_last"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be an int >= 1, got {v!r}")
        if not isinstance(self.tier2_keep_every, int) or self.tier2_keep_every < 0:
            raise ConfigError(f"tier2-keep-every must be an int >= 0 (0 = off), got "
                              f"{self.tier2_keep_every!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GcPlan:
    """What gc deletes (or, in a dry run, would delete), oldest first, and why the rest of
    tier 1 stays. ``tier2`` is None when no tier 2 was given."""

    tier1: tuple[int, ...]
    tier1_stale: tuple[str, ...]
    tier1_kept: dict[int, str]
    tier2: tuple[int, ...] | None
    tier2_kept: tuple[int, ...] = ()
    applied: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "tier1": {
            "delete": list(self.tier1), "stale": list(self.tier1_stale),
            "keep": {str(s): why for s, why in sorted(self.tier1_kept.items(), reverse=True)}},
            "tier2": None if self.tier2 is None else {"delete": list(self.tier2),
                                                      "keep": list(self.tier2_kept)}}


def plan_gc(policy: GcPolicy, *, tier1_complete: Iterable[int], pinned: Iterable[int] = (),
            uploaded: Iterable[int] | None = None, tier2_complete: Iterable[int] | None = None,
            tier1_stale: Iterable[str] = ()) -> GcPlan:
    """Pure. ``uploaded`` is the set of steps the uploader finished (None: the root has no
    uploader, so nothing is held for it); ``tier2_complete`` None: no tier 2 given."""
    complete = sorted(set(tier1_complete), reverse=True)
    pins = set(pinned)
    holds = set() if uploaded is None else retention.tier1_upload_holds(
        complete, upload_every=policy.upload_every, done=uploaded)
    doomed = retention.tier1_deletions(complete, keep_last=policy.keep_last,
                                       pinned=pins | holds)
    kept: dict[int, str] = {}
    for i, s in enumerate(complete):
        if s in doomed:
            continue
        kept[s] = ("newest" if i == 0 else "pinned" if s in pins
                   else "not yet on tier 2" if s in holds else f"keep-last {policy.keep_last}")
    t2: tuple[int, ...] | None = None
    t2_kept: tuple[int, ...] = ()
    if tier2_complete is not None:
        remote = sorted(set(tier2_complete))
        t2 = tuple(retention.tier2_deletions(remote, keep_last=policy.tier2_keep_last,
                                             keep_every=policy.tier2_keep_every))
        t2_kept = tuple(s for s in reversed(remote) if s not in t2)
    return GcPlan(tier1=tuple(doomed), tier1_stale=tuple(sorted(tier1_stale)), tier1_kept=kept,
                  tier2=t2, tier2_kept=t2_kept)


def _stale_names(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if (root / n).is_dir() and not (root / n).is_symlink()
            and (layout.parse_tmp_dirname(n) or layout.is_deleting_dirname(n))]


def collect(tier1: Path, policy: GcPolicy, *, storage: Storage | None = None,
            apply: bool = False) -> GcPlan:
    """Plan (and with ``apply=True`` carry out) gc of ``tier1`` and, when given, tier 2,
    holding ``<tier1>/.lock`` throughout. Raises :class:`ConfigError` when ``tier1`` is not
    a directory and :class:`~tierckpt.errors.LockError` when a job holds the root."""
    root = Path(tier1)
    if not root.is_dir():
        raise ConfigError(f"tier-1 root {str(root)!r} is not a directory")
    lock = RootLock(root)
    try:
        has_uploader = (root / layout.UPLOAD_STATE).is_dir() or storage is not None
        plan = plan_gc(policy, tier1_complete=complete_steps(root),
                       pinned=tier1_pins(root).keys(),
                       uploaded=uploaded_steps(root) if has_uploader else None,
                       tier2_complete=None if storage is None else remote_complete_steps(storage),
                       tier1_stale=_stale_names(root))
        if not apply:
            return plan
        for step in plan.tier1:
            commit.delete_checkpoint(root, step, uuid.uuid4().hex[:8])
        commit.clean_stale(root)
        if storage is not None:
            for step in plan.tier2 or ():
                delete_remote(storage, step)
        return dataclasses.replace(plan, applied=True)
    finally:
        lock.release()
