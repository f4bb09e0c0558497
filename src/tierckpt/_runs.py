"""Cutting an ordered list of pieces into a few contiguous runs of about equal size: the
restore's read streams (each one sequential stretch of a file) and the stager's batches of
copies (a few hand-offs to the copy threads, not one per tensor) both need it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

P = TypeVar("P")


def contiguous_runs(pieces: list[P], k: int, size: Callable[[P], int]) -> list[list[P]]:
    """``pieces`` (order kept) cut into at most ``k`` contiguous runs of about equal total
    ``size``, none empty (no runs for no pieces)."""
    total = sum(size(p) for p in pieces)
    runs: list[list[P]] = [[]]
    acc = 0
    for piece in pieces:
        if runs[-1] and acc >= total * len(runs) / k and len(runs) < k:
            runs.append([])
        runs[-1].append(piece)
        acc += size(piece)
    return runs if pieces else []
