"""``contiguous_runs``: order kept, at most k runs, none empty, about equal sizes."""

from __future__ import annotations

import pytest

from tierckpt._runs import contiguous_runs


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_runs_keep_order_and_balance(k: int) -> None:
    sizes = [1] * 300 + [1000] * 4 + [5] * 20
    runs = contiguous_runs(sizes, k, lambda s: s)
    assert len(runs) <= k and all(runs) and [s for r in runs for s in r] == sizes
    assert max(sum(r) for r in runs) <= sum(sizes) / len(runs) + 1000


def test_fewer_pieces_than_runs_and_none() -> None:
    assert contiguous_runs([3, 4], 5, lambda s: s) == [[3], [4]]
    assert contiguous_runs([], 3, lambda s: s) == []
