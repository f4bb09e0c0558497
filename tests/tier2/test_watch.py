"""The one upload loop (tierckpt.tier2.uploader.watch): order, stopping, back-off."""

from __future__ import annotations

import threading
import time

import pytest

from tierckpt.tier2.uploader import watch
from tierckpt.tier2.uploader.config import UploadResult


class Script:
    """A source that hands out ``steps`` in order, with the given statuses, and records
    the waits the loop makes through a stop event that never blocks."""

    def __init__(self, plan: list[tuple[int | None, str]]) -> None:
        self.plan = list(plan)
        self.uploaded: list[int] = []
        self.waits: list[float] = []
        self.status: dict[int, str] = {}

    def next_step(self) -> int | None:
        step, status = self.plan.pop(0) if self.plan else (None, "")
        if step is not None:
            self.status[step] = status
        return step

    def upload_step(self, step: int, *, stop: threading.Event | None = None) -> UploadResult:
        self.uploaded.append(step)
        return UploadResult(step, self.status[step])


class CountingStop(threading.Event):
    def __init__(self, source: Script, after: int) -> None:
        super().__init__()
        self.source, self.after = source, after

    def wait(self, timeout: float | None = None) -> bool:
        self.source.waits.append(timeout or 0.0)
        if len(self.source.waits) >= self.after:
            self.set()
        return self.is_set()


def test_drain_stops_when_idle_or_on_the_first_failure() -> None:
    src = Script([(4, "verified"), (3, "gone"), (2, "failed"), (1, "verified")])
    assert watch.run(src, threading.Event(), poll_s=1, watch=False) is False
    assert src.uploaded == [4, 3, 2]  # "gone" is not a failure; "failed" ends the drain
    src = Script([(4, "verified")])
    assert watch.run(src, threading.Event(), poll_s=1, watch=False) is True


def test_watch_backs_off_exponentially_while_failing_and_resets() -> None:
    src = Script([(5, "failed"), (5, "failed"), (5, "failed"), (5, "verified"), (None, "")])
    stop = CountingStop(src, after=4)
    assert watch.run(src, stop, poll_s=2.0, watch=True) is False  # ended by stop
    # 2·2^n while failing, less up to half of it (jitter), then the idle poll
    assert [d / 2 <= w <= d for w, d in zip(src.waits, (4.0, 8.0, 16.0), strict=False)] \
        == [True] * 3 and 0 < src.waits[3] <= 2.0 + 0.01
    waits = {watch.backoff_s(2.0, 30) for _ in range(50)}
    assert all(watch.MAX_BACKOFF_S / 2 <= w <= watch.MAX_BACKOFF_S for w in waits)
    assert len(waits) > 40  # jittered: uploaders refused together do not retry together


def test_an_idle_uploader_looks_just_after_the_next_wall_clock_multiple_of_its_poll() -> None:
    """So that every node's uploader looks at one moment (Uploader.next_step)."""
    for poll_s in (2.0, 0.3):
        w = watch.backoff_s(poll_s, 0)
        end = time.time() + w
        assert 0 < w <= poll_s + 0.01
        assert abs(end % poll_s - 0.01) < 0.005, (poll_s, w, end % poll_s)


@pytest.mark.slow
def test_finish_returns_once_nothing_is_due() -> None:
    finish = threading.Event()
    finish.set()
    src = Script([(6, "verified"), (None, "")])
    seen: list[int] = []
    assert watch.run(src, threading.Event(), poll_s=1, watch=True, finish=finish,
                     started=seen.append) is True
    assert seen == [6] and src.waits == []
