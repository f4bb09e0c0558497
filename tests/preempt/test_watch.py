"""The agreed stop step, through a real TCPStore: every rank gets the same target, no rank
has passed it, whichever rank got the notice; a rank that never reports fails the agreement
before the deadline instead of hanging."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.preempt.notice import Notice, NoticeBox
from tierckpt.preempt.watch import StopWatch


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                         timeout=datetime.timedelta(seconds=10))


def _watches(store: dist.TCPStore, n: int, key: str, **kw: object) -> list[StopWatch]:
    return [StopWatch(NoticeBox(), store=store.clone(), rank=r, world_size=n, key=key,
                      poll_s=0.01, **kw) for r in range(n)]  # type: ignore[arg-type]


def _lockstep(watches: list[StopWatch], notice_at: dict[int, int], lag: dict[int, int],
              limit: int = 200) -> dict[int, int]:
    """Each rank's loop, in a thread: steps 0.. with a barrier per step (the step's
    collective), rank r sleeping ``lag[r]`` ms before each check and posting its notice at
    step ``notice_at[r]``. Returns the stop step per rank."""
    n = len(watches)
    barrier = threading.Barrier(n)
    stops: dict[int, int] = {}

    def loop(r: int) -> None:
        w = watches[r]
        for step in range(limit):
            if step == notice_at.get(r):
                w.box.post(Notice.now("test", grace_s=30.0))
            time.sleep(0.001 * lag.get(r, 0))
            w.progress = max(w.progress, step)
            target = w.wait_target(step)
            if target is not None and step >= target:
                stops[r] = step
                return
            barrier.wait(timeout=30)  # the step's collective: nobody runs ahead by two

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return stops


@pytest.mark.slow  # 15 examples, 16 s: out of make test-fast (make test runs it)
@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 4), at=st.integers(0, 30), who=st.data(),
       lags=st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_every_rank_stops_at_the_same_step_after_the_notice(
        n: int, at: int, who: st.DataObject, lags: list[int]) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=10))
    ranks = who.draw(st.sets(st.integers(0, n - 1), min_size=1))
    watches = [w.start() for w in _watches(store, n, f"k{at}")]
    try:
        stops = _lockstep(watches, {r: at + r % 2 for r in ranks}, dict(enumerate(lags)))
    finally:
        for w in watches:
            w.close()
    assert sorted(stops) == list(range(n)), stops
    assert len(set(stops.values())) == 1, stops
    target = stops[0]
    first = min(at + r % 2 for r in ranks)
    assert first <= target <= first + 2  # the notice's step, or one or two after it
    assert all(w.target == target and w.error is None for w in watches)


def test_the_notice_reaches_ranks_that_got_none(store: dist.TCPStore) -> None:
    watches = [w.start() for w in _watches(store, 3, "one")]
    watches[2].box.post(Notice.now("signal:SIGTERM", grace_s=30.0))
    try:
        deadline = time.monotonic() + 20
        while not all(w.noticed for w in watches) and time.monotonic() < deadline:
            time.sleep(0.01)
        for w in watches:
            assert w.wait_target(w.progress) == 0  # nobody had passed a check: -1 + 1
    finally:
        for w in watches:
            w.close()
    assert watches[2].notice is not None and watches[2].notice.source == "signal:SIGTERM"
    for w in watches[:2]:
        assert w.notice is not None and w.notice.source == "rank:2"
        assert w.notice.detail == "signal:SIGTERM"
        assert w.notice.deadline_unix == watches[2].notice.deadline_unix


def test_a_rank_that_never_reports_fails_the_agreement_before_the_deadline(
        store: dist.TCPStore) -> None:
    watches = _watches(store, 3, "dead", margin_s=29.5)
    live = [w.start() for w in watches[:2]]  # rank 2 is dead: its watcher never runs
    live[0].box.post(Notice.now("signal:SIGTERM", grace_s=30.0))
    try:
        for w in live:
            assert w.wait_target(0) is None
            assert w.error is not None and "1 of 3 ranks did not report" in w.error
    finally:
        for w in live:
            w.close()


def test_a_single_process_stops_at_the_step_it_is_at() -> None:
    w = StopWatch(NoticeBox(), store=None, rank=0, world_size=1, key="k", poll_s=0.01)
    assert w.wait_target(4) is None  # no notice: nothing to wait for
    w.box.post(Notice.now("file:/x", grace_s=5.0))
    assert w.wait_target(5) == 5
    assert w.wait_target(6) == 5  # settled


class _Poller:
    name, every_s = "fake", 0.01

    def __init__(self) -> None:
        self.calls = 0

    def poll(self) -> Notice | None:
        self.calls += 1
        if self.calls == 1:
            raise OSError("metadata server not reachable")
        return Notice.now("aws", grace_s=120.0) if self.calls >= 3 else None


def test_pollers_post_to_the_box_and_their_errors_do_not_stop_the_watcher() -> None:
    p = _Poller()
    w = StopWatch(NoticeBox(), store=None, rank=0, world_size=1, key="k", poll_s=0.01,
                  pollers=(p,)).start()
    try:
        deadline = time.monotonic() + 20
        while not w.noticed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.box.first is not None and w.box.first.source == "aws"
        assert p.calls >= 3
    finally:
        w.close()
