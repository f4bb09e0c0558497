"""Which checkpoints each tier keeps or may delete, as pure functions of values.

Rules shared by every tier: a checkpoint is deleted only when a newer complete one exists,
and a pinned checkpoint is never deleted.
"""

from __future__ import annotations

from collections.abc import Iterable


def tier1_deletions(complete_steps: Iterable[int], *, keep_last: int,
                    pinned: Iterable[int] = ()) -> list[int]:
    """Steps to delete from tier 1, oldest first.

    Keeps the newest ``keep_last`` complete checkpoints and every pinned one (e.g. one the
    tier-2 uploader still has to copy). Never returns the newest complete step, whatever
    ``keep_last`` is, so one complete checkpoint always remains once one existed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
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
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if keep_every < 0:
        raise ValueError(f"keep_every must be >= 0 (0 = keep none forever), got {keep_every}")
    steps = sorted(set(complete_steps), reverse=True)
    keep = set(steps[:keep_last]) | set(pinned)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return sorted(s for s in steps[1:] if s not in keep)


def upload_due(step: int, *, upload_every: int) -> bool:
    """Whether the tier-2 policy uploads ``step`` (every ``upload_every``-th step; 1 = all)."""
    if upload_every < 1:
        raise ValueError(f"upload_every must be >= 1, got {upload_every}")
    return step % upload_every == 0


def next_upload(complete_steps: Iterable[int], *, upload_every: int,
                done: Iterable[int]) -> int | None:
    """The step the uploader should copy next, or None.

    Newest first: the newest due step that is not done, provided it is newer than every
    done step. A due step older than the newest done one is abandoned (a newer copy
    already exists), so a slow uploader skips ahead instead of falling further behind.
    """
    done_set = set(done)
    floor = max(done_set, default=-1)
    due = [s for s in complete_steps if upload_due(s, upload_every=upload_every)
           and s not in done_set and s > floor]
    return max(due, default=None)


def tier1_upload_holds(complete_steps: Iterable[int], *, upload_every: int,
                       done: Iterable[int]) -> set[int]:
    """Tier-1 steps retention must keep because the uploader may still copy them: due,
    not done, and newer than the newest done step (see :func:`next_upload`). Pass them to
    :func:`tier1_deletions` as ``pinned``."""
    done_set = set(done)
    floor = max(done_set, default=-1)
    return {s for s in complete_steps if upload_due(s, upload_every=upload_every)
            and s not in done_set and s > floor}
