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
