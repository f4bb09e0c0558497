"""Garbage collection of both tiers outside a running job: what ``tierckpt gc`` does.

:func:`plan_gc` is pure: from the steps on each tier, the pins and the uploader's progress
it decides what retention would delete (:func:`tierckpt.policy.retention.tier1_plan`, the
same plan the job applies), so it inherits its guarantees: the newest complete checkpoint
of a tier is never deleted, nor a pinned one, nor a tier-1 checkpoint the uploader still has
to copy (when the root has an uploader: ``<tier1>/upload-state/`` exists, or a tier 2 is
given — offline, the job's own configuration is unknown, so gc assumes the safer case).

:func:`collect` does it: it takes the tier-1 root lock (``<tier1>/.lock``, the one a live
job holds for its lifetime, so gc can never race a job's saves or retention; a held lock
raises :class:`~tierckpt.errors.LockError`), reads both tiers through their catalogues,
plans, and, only with ``apply=True``, deletes: tier-1 checkpoints by rename-then-remove,
leftover tmp/half-deleted directories of crashed saves, and tier-2 checkpoints marker first
(then, once, the content objects no remaining tier-2 step references:
:meth:`~tierckpt.tier2.catalog.Tier2Catalog.sweep`).
Directories without a marker under a final name and quarantined checkpoints are never
touched: they are evidence, for a person to look at.

:func:`resolve_policy` decides the knobs: each one given explicitly (a flag) wins; else the
value the job recorded for the root when it started with a tier 2
(``<tier1>/upload-state/policy.json``, :meth:`Tier1Catalog.recorded_policy`), so a gc that
does not repeat ``--tier2-keep-every`` never deletes the milestones the job keeps forever;
else the defaults of :class:`RetentionPolicy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError, IntegrityError
from tierckpt.policy import retention
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.tier1.catalog import RecordedPolicy, Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import Storage

GcPolicy = RetentionPolicy
"""Retention to apply: the same knobs (and validation) as :class:`tierckpt.ManagerConfig`."""

KNOBS = ("keep_last", "upload_every", "tier2_keep_last", "tier2_keep_every")
FROM_FLAGS, FROM_JOB, FROM_DEFAULTS = "flags", "recorded by the job", "defaults"
"""Where a knob of a :class:`ResolvedPolicy` came from."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedPolicy:
    """The policy gc applies, where each knob came from (``sources``: :data:`FROM_FLAGS`,
    :data:`FROM_JOB` or :data:`FROM_DEFAULTS`), and the job's record (None: none)."""

    policy: RetentionPolicy
    sources: dict[str, str]
    recorded: RecordedPolicy | None = None

    def describe(self) -> str:
        """``"keep-last 2 (flags), upload-every 1 (recorded by the job), ..."``"""
        return ", ".join(f"{k.replace('_', '-')} {getattr(self.policy, k)} ({self.sources[k]})"
                         for k in KNOBS)

    def to_json(self) -> dict[str, Any]:
        rec = self.recorded
        return {**{k: getattr(self.policy, k) for k in KNOBS}, "from": dict(self.sources),
                "recorded": None if rec is None else str(rec.path),
                "recorded_tier2": None if rec is None else rec.tier2}


def resolve_policy(tier1: Path, *, keep_last: int | None = None,
                   upload_every: int | None = None, tier2_keep_last: int | None = None,
                   tier2_keep_every: int | None = None) -> ResolvedPolicy:
    """The policy for gc of ``tier1``: each knob given (not None) as given, else as the job
    recorded it (:meth:`Tier1Catalog.recorded_policy`), else the default. Raises
    :class:`ConfigError` naming a bad knob, and :class:`IntegrityError` when a knob is left
    to a record that cannot be read (gc must not guess what the job keeps)."""
    given = {"keep_last": keep_last, "upload_every": upload_every,
             "tier2_keep_last": tier2_keep_last, "tier2_keep_every": tier2_keep_every}
    try:
        recorded = Tier1Catalog(tier1).recorded_policy()
    except IntegrityError:
        if any(v is None for v in given.values()):
            raise
        recorded = None  # every knob given: the record is not needed
    defaults = RetentionPolicy()
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    for k, v in given.items():
        if v is not None:
            values[k], sources[k] = v, FROM_FLAGS
        elif recorded is not None:
            values[k], sources[k] = getattr(recorded.policy, k), FROM_JOB
        else:
            values[k], sources[k] = getattr(defaults, k), FROM_DEFAULTS
    return ResolvedPolicy(policy=RetentionPolicy(**values), sources=sources, recorded=recorded)


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


def plan_gc(policy: RetentionPolicy, *, tier1_complete: Iterable[int],
            pinned: Iterable[int] = (), uploaded: Iterable[int] | None = None,
            marked: Iterable[int] = (), tier2_complete: Iterable[int] | None = None,
            tier1_stale: Iterable[str] = ()) -> GcPlan:
    """Pure. ``uploaded`` is the set of steps the uploader finished (None: the root has no
    uploader, so nothing is held for it); ``marked``: steps the job marked or requested for
    tier 2 (held while due); ``tier2_complete`` None: no tier 2 given."""
    t1 = retention.tier1_plan(tier1_complete, policy=policy, pinned=pinned, uploaded=uploaded,
                              marked=marked)
    t2: tuple[int, ...] | None = None
    t2_kept: tuple[int, ...] = ()
    if tier2_complete is not None:
        remote = sorted(set(tier2_complete))
        t2 = tuple(retention.tier2_deletions(remote, keep_last=policy.tier2_keep_last,
                                             keep_every=policy.tier2_keep_every))
        t2_kept = tuple(s for s in reversed(remote) if s not in t2)
    return GcPlan(tier1=t1.delete, tier1_stale=tuple(sorted(tier1_stale)), tier1_kept=t1.kept,
                  tier2=t2, tier2_kept=t2_kept)


def collect(tier1: Path, policy: RetentionPolicy, *, storage: Storage | None = None,
            apply: bool = False) -> GcPlan:
    """Plan (and with ``apply=True`` carry out) gc of ``tier1`` and, when given, tier 2,
    holding ``<tier1>/.lock`` throughout. Raises :class:`ConfigError` when ``tier1`` is not
    a directory and :class:`~tierckpt.errors.LockError` when a job holds the root."""
    cat = Tier1Catalog(tier1)
    if not cat.root.is_dir():
        raise ConfigError(f"tier-1 root {str(cat.root)!r} is not a directory")
    remote = None if storage is None else Tier2Catalog(storage)
    lock = cat.lock()
    try:
        has_uploader = cat.uploads.has_upload_records() or remote is not None
        pinned, asked = cat.uploads.split_pins()
        plan = plan_gc(policy, tier1_complete=cat.complete_steps(), pinned=pinned,
                       uploaded=cat.uploads.uploaded_steps() if has_uploader else None,
                       marked=asked,
                       tier2_complete=None if remote is None else remote.complete_steps(),
                       tier1_stale=[p.name for p in cat.stale_entries()])
        if not apply:
            return plan
        for step in plan.tier1:
            cat.delete(step)
        cat.clean_stale()
        for step in plan.tier2 or ():
            assert remote is not None
            remote.delete(step, sweep=False)
        if remote is not None and plan.tier2:
            remote.sweep()  # once: the content objects no remaining step references
        return dataclasses.replace(plan, applied=True)
    finally:
        lock.release()
