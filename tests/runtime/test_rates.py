"""The emergency-save chain's inputs measured from event records (values only, no files)."""

from __future__ import annotations

from typing import Any

import pytest

from tierckpt.runtime import events as ev
from tierckpt.runtime.rates import RECENT, measure_chain

GB = 10**9


def _e(kind: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "t": t, "rank": fields.pop("rank", 0), "pid": fields.pop("pid", 1),
            **fields}


def test_nothing_measured_from_an_empty_log() -> None:
    m = measure_chain([])
    assert (m.nbytes, m.rates, m.stage_s, m.step_s) == (None, {}, None, None)


def test_bytes_sum_the_ranks_and_rates_take_the_slowest_save() -> None:
    recs = []
    for i, write_s in enumerate((10.0, 20.0, 12.0)):
        step, t = 100 * (i + 1), 1000.0 * (i + 1)
        for rank in (0, 1):
            recs.append(_e(ev.SAVE_DURABLE, t, rank=rank, step=step, bytes=5 * GB,
                           seconds=5.0, tier="tier1"))
            recs.append(_e(ev.SAVE_COMMITTED, t + 1, rank=rank, step=step, bytes=10 * GB,
                           write_seconds=write_s + rank, tier="tier1"))
    m = measure_chain(recs)
    assert m.nbytes is not None and m.nbytes.value == 10 * GB
    assert m.rates["tier1"].value == pytest.approx(10 * GB / 21.0)  # slowest rank, slowest save
    assert "slowest of the last 3" in m.rates["tier1"].source


def test_without_save_durable_the_committed_bytes_are_used() -> None:
    m = measure_chain([_e(ev.SAVE_COMMITTED, 1.0, step=5, bytes=7 * GB, write_seconds=7.0,
                          tier="tier1")])
    assert m.nbytes is not None and m.nbytes.value == 7 * GB
    assert m.rates["tier1"].value == pytest.approx(1 * GB)


def test_only_the_newest_saves_count() -> None:
    slow_then_fast = [_e(ev.SAVE_COMMITTED, float(i), step=i, bytes=GB, tier="tier1",
                         write_seconds=100.0 if i == 0 else 1.0) for i in range(RECENT + 1)]
    m = measure_chain(slow_then_fast)
    assert m.rates["tier1"].value == pytest.approx(GB / 1.0)


def test_a_ram_only_save_and_a_flush_give_no_tier1_rate() -> None:
    m = measure_chain([
        _e(ev.SAVE_COMMITTED, 1.0, step=1, bytes=GB, write_seconds=2.0, tier="tier0"),
        _e(ev.SAVE_COMMITTED, 2.0, step=1, bytes=GB, write_seconds=0.0, tier="tier1",
           flushed=True),
    ])
    assert "tier1" not in m.rates


def test_tier0_and_the_tier1_copy_after_it() -> None:
    recs = []
    for rank, secs in ((0, 1.0), (1, 2.0)):
        recs.append(_e(ev.SAVE_DURABLE, 1.0, rank=rank, step=7, bytes=4 * GB, tier="tier0"))
        recs.append(_e(ev.TIER0_SAVED, 2.0, rank=rank, step=7, bytes=4 * GB, seconds=secs))
        recs.append(_e(ev.TIER0_REPLICATED, 3.0, rank=rank, step=7, bytes=4 * GB, seconds=3.0))
        recs.append(_e(ev.SAVE_COMMITTED, 9.0, rank=rank, step=7, bytes=8 * GB,
                       write_seconds=9.0, tier="tier1"))
    m = measure_chain(recs)
    assert m.rates["tier0"].value == pytest.approx(8 * GB / 2.0)
    assert m.rates["tier1"].value == pytest.approx(8 * GB / (9.0 - 2.0 - 3.0))


def test_upload_rate_stage_and_step_time() -> None:
    recs = [
        _e(ev.UPLOAD_VERIFIED, 1.0, step=1, bytes=10 * GB, seconds=50.0),
        _e(ev.UPLOAD_VERIFIED, 2.0, step=2, bytes=10 * GB, seconds=40.0),
        _e(ev.SAVE_STAGED, 3.0, step=2, rank=0, seconds=1.0),
        _e(ev.SAVE_STAGED, 3.0, step=2, rank=1, seconds=3.0),
        _e(ev.SAVE_STAGED, 4.0, step=3, rank=0, seconds=2.0),
        _e(ev.PROGRESS, 10.0, step=10, pid=7),
        _e(ev.PROGRESS, 11.0, step=50, pid=8),  # another process: not a delta
        _e(ev.PROGRESS, 20.0, step=20, pid=7),
        _e(ev.PROGRESS, 40.0, step=30, pid=7),
    ]
    m = measure_chain(recs)
    assert m.rates["tier2"].value == pytest.approx(10 * GB / 50.0)
    assert m.stage_s is not None and m.stage_s.value == 3.0
    assert m.step_s is not None and m.step_s.value == pytest.approx(1.5)  # median of 1, 2
    decided = [*recs, _e(ev.INTERVAL_DECIDED, 50.0, step_s=0.25)]
    step = measure_chain(decided).step_s
    assert step is not None and step.value == 0.25 and "interval_decided" in step.source
