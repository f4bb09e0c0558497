"""Which checkpoints each tier keeps or may delete, as pure functions of values.

Rules shared by every tier: a checkpoint is deleted only when a newer complete one exists,
and a pinned checkpoint is never deleted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from tierckpt.policy.units import check_count


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """What each tier keeps, validated once: the job's config, ``tierckpt gc`` and the
    uploader all hold one of these."""

    keep_last: int = 3
    """Tier 1: newest complete checkpoints kept (pinned ones are kept in addition)."""
    upload_every: int = 1
    """Every Nth checkpoint committed on tier 1 is due for tier 2 (kept on tier 1 until
    copied); 1 = every one. The job marks each Nth commit as it happens (the ``marked``
    steps below): a step number says nothing about it."""
    tier2_keep_last: int = 3
    """Tier 2: newest complete checkpoints kept."""
    tier2_keep_every: int = 0
    """Tier 2: steps that are multiples of this are kept forever (0: none)."""
    upload_backlog: int | None = None
    """Tier 1: at most this many not-yet-uploaded checkpoints are held beyond ``keep_last``
    (the oldest held one is released first); None holds every one — a tier 2 that stays
    down then fills the disk."""

    def __post_init__(self) -> None:
        check_count("keep_last", self.keep_last)
        check_count("upload_every", self.upload_every)
        check_count("tier2_keep_last", self.tier2_keep_last)
        check_count("tier2_keep_every", self.tier2_keep_every, minimum=0)
        if self.upload_backlog is not None:
            check_count("upload_backlog", self.upload_backlog, minimum=0)


def tier1_deletions(complete_steps: Iterable[int], *, keep_last: int,
                    pinned: Iterable[int] = ()) -> list[int]:
    """Steps to delete from tier 1, oldest first.

    Keeps the newest ``keep_last`` complete checkpoints and every pinned one (e.g. one the
    tier-2 uploader still has to copy). Never returns the newest complete step, whatever
    ``keep_last`` is, so one complete checkpoint always remains once one existed.
    """
    check_count("keep_last", keep_last)
    steps = sorted(set(complete_steps), reverse=True)
    keep = set(steps[:keep_last]) | set(pinned)
    return sorted(s for s in steps[1:] if s not in keep)


def tier2_deletions(complete_steps: Iterable[int], *, keep_last: int, keep_every: int = 0,
                    pinned: Iterable[int] = ()) -> list[int]:
    """Steps to delete from tier 2 (object storage), oldest first.

    Keeps the newest ``keep_last`` complete checkpoints, every step that is a multiple of
    ``keep_every`` forever (0 = none), and every pinned step. Like tier 1, never returns the
    newest complete step.
    """
    check_count("keep_last", keep_last)
    check_count("keep_every", keep_every, minimum=0)
    steps = sorted(set(complete_steps), reverse=True)
    keep = set(steps[:keep_last]) | set(pinned)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return sorted(s for s in steps[1:] if s not in keep)


def upload_due(step: int, *, upload_every: int, marked: AbstractSet[int] = frozenset()
               ) -> bool:
    """Whether the tier-2 policy uploads ``step``: every committed checkpoint when
    ``upload_every`` is 1, else those the job ``marked`` as its every-Nth commit
    (:func:`count_commit`)."""
    check_count("upload_every", upload_every)
    return upload_every == 1 or step in marked


def count_commit(count: int, *, upload_every: int) -> tuple[int, bool]:
    """One more checkpoint committed on tier 1, with ``count`` committed since the last
    one marked for tier 2: returns the new count and whether this one is marked (the
    ``upload_every``-th): the Nth, 2Nth, ... commits are marked — a cadence that always
    meets the saves, whatever step numbers they land on."""
    check_count("upload_every", upload_every)
    count += 1
    return (0, True) if count >= upload_every else (count, False)


def _due(complete_steps: Iterable[int], *, upload_every: int, done: Iterable[int],
         requested: Iterable[int], marked: Iterable[int]) -> set[int]:
    done_set, asked, marks = set(done), set(requested), set(marked)
    floor = max(done_set, default=-1)
    return {s for s in complete_steps
            if (s in asked or upload_due(s, upload_every=upload_every, marked=marks))
            and s not in done_set and s > floor}


def next_upload(complete_steps: Iterable[int], *, upload_every: int,
                done: Iterable[int], requested: Iterable[int] = (),
                marked: Iterable[int] = ()) -> int | None:
    """The step the uploader should copy next, or None.

    Newest first: the newest due step (:func:`upload_due`) that is not done, provided it is
    newer than every done step. A due step older than the newest done one is abandoned (a
    newer copy already exists), so a slow uploader skips ahead instead of falling further
    behind. ``requested`` steps are due whatever ``upload_every`` says (an emergency save,
    the final step of a clean end).
    """
    return max(_due(complete_steps, upload_every=upload_every, done=done,
                    requested=requested, marked=marked), default=None)


def tier1_upload_holds(complete_steps: Iterable[int], *, upload_every: int,
                       done: Iterable[int], requested: Iterable[int] = (),
                       marked: Iterable[int] = ()) -> set[int]:
    """Tier-1 steps retention must keep because the uploader may still copy them: due,
    not done, and newer than the newest done step (see :func:`next_upload`). Pass them to
    :func:`tier1_deletions` as ``pinned``. ``requested``, ``marked``: as for
    :func:`next_upload`."""
    return _due(complete_steps, upload_every=upload_every, done=done, requested=requested,
                marked=marked)


@dataclasses.dataclass(frozen=True)
class Tier1Plan:
    """What tier-1 retention deletes (oldest first) and why each other step stays:
    ``"newest"``, ``"pinned"``, ``"not yet on tier 2"`` or ``"keep-last N"``. ``released``:
    steps due for upload that are deleted anyway because the upload backlog is full."""

    delete: tuple[int, ...]
    kept: dict[int, str]
    released: tuple[int, ...] = ()


def tier1_plan(complete_steps: Iterable[int], *, policy: RetentionPolicy,
               pinned: Iterable[int] = (), uploaded: Iterable[int] | None,
               marked: Iterable[int] = ()) -> Tier1Plan:
    """Tier-1 retention as the job and ``tierckpt gc`` both apply it: keep-last, pins, and
    — when the root has an uploader (``uploaded`` is its set of done steps; None: no
    uploader, nothing is held for it) — every step it may still copy
    (:func:`tier1_upload_holds`; ``marked``: the job's every-Nth commits and requests), at
    most ``policy.upload_backlog`` of them beyond the newest ``keep_last``."""
    complete = sorted(set(complete_steps), reverse=True)
    pins = set(pinned)
    holds = set() if uploaded is None else tier1_upload_holds(
        complete, upload_every=policy.upload_every, done=uploaded, marked=marked)
    released: set[int] = set()
    if policy.upload_backlog is not None:  # hold only the newest few beyond keep-last
        extra = sorted(holds - set(complete[:policy.keep_last]) - pins, reverse=True)
        released = set(extra[policy.upload_backlog:])
        holds -= released
    doomed = tier1_deletions(complete, keep_last=policy.keep_last, pinned=pins | holds)
    kept: dict[int, str] = {}
    for i, s in enumerate(complete):
        if s not in doomed:
            kept[s] = ("newest" if i == 0 else "pinned" if s in pins
                       else "not yet on tier 2" if s in holds else f"keep-last {policy.keep_last}")
    return Tier1Plan(delete=tuple(doomed), kept=kept,
                     released=tuple(s for s in doomed if s in released))
