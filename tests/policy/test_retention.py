from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierckpt.policy.retention import tier1_deletions


def test_keeps_last_and_pinned() -> None:
    assert tier1_deletions([1, 2, 3, 4, 5], keep_last=2) == [1, 2, 3]
    assert tier1_deletions([1, 2, 3, 4, 5], keep_last=2, pinned=[2]) == [1, 3]
    assert tier1_deletions([5], keep_last=1) == []
    with pytest.raises(ValueError):
        tier1_deletions([1], keep_last=0)


@given(st.sets(st.integers(0, 50), max_size=12), st.integers(1, 5),
       st.sets(st.integers(0, 50), max_size=4))
def test_never_deletes_newest_or_pinned(steps: set[int], keep: int, pinned: set[int]) -> None:
    dels = tier1_deletions(steps, keep_last=keep, pinned=pinned)
    assert set(dels) <= steps
    assert not set(dels) & pinned
    if steps:
        assert max(steps) not in dels
        assert len(steps) - len(dels) >= min(keep, len(steps))
