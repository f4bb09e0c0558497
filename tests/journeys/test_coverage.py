"""Every block a page marks runnable is run by a journey that asserts its promise."""

from __future__ import annotations

from tests.journeys import _run
from tests.test_docs import BLOCKS


def test_every_runnable_block_has_a_journey() -> None:
    runnable: dict[str, int] = {}
    found = set()
    for b in BLOCKS:
        if b.mark.startswith("run"):
            found.add((b.page, runnable.get(b.page, 0)))
            runnable[b.page] = runnable.get(b.page, 0) + 1
    assert found == _run.COVERED, (
        f"runnable blocks without a journey: {sorted(found - _run.COVERED)}; journeys of "
        f"blocks that are gone: {sorted(_run.COVERED - found)}")
