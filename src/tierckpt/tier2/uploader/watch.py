"""The upload loop: what runs next, when to wait, how long to back off. One loop for the
uploader process, :meth:`Uploader.drain` and ``tierckpt upload [--watch]``.

Timing only: *what* is due comes from the source's ``next_step()`` (the pure policy
:func:`tierckpt.policy.retention.next_upload`) and *moving bytes* from its ``upload_step``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tierckpt.tier2.uploader.config import OK, UploadResult

MAX_BACKOFF_S = 300.0
"""Longest wait between attempts while uploads keep failing."""


class Source(Protocol):
    """What the loop drives (an :class:`~tierckpt.tier2.uploader.Uploader`)."""

    def next_step(self) -> int | None: ...

    def upload_step(self, step: int, *, stop: threading.Event | None = None) -> UploadResult: ...


_PAST_EPOCH_S = 0.01
"""How long after an epoch's start an idle uploader looks (the markers of a commit at the
boundary are on disk)."""


def backoff_s(poll_s: float, failures: int) -> float:
    """Wait before the next look: when idle, until just past the next wall-clock multiple of
    ``poll_s`` (at most ``poll_s``: every node's uploader then looks at one moment, the start
    of an epoch, and chooses among the same commits); after ``failures`` consecutive
    failures a wait drawn uniformly from ``[d/2, d]``, ``d = poll_s · 2^failures`` (capped at
    :data:`MAX_BACKOFF_S`). The jitter keeps hundreds of uploaders that a throttling store
    refused together from all trying again in the same instant."""
    if failures == 0:  # at the next wall-clock multiple of poll_s: see Uploader.next_step
        return poll_s - time.time() % poll_s + _PAST_EPOCH_S
    d = min(poll_s * 2 ** min(failures, 10), MAX_BACKOFF_S)
    return d * (0.5 + 0.5 * random.random())


def run(source: Source, stop: threading.Event, *, poll_s: float, watch: bool,
        finish: threading.Event | None = None,
        started: Callable[[int], None] | None = None,
        finished: Callable[[UploadResult], None] | None = None) -> bool:
    """Upload due steps, newest first, until ``stop`` is set (checked between files).

    Without ``watch``, return as soon as nothing is due (True) or an upload does not finish
    (False). With ``watch``, poll every ``poll_s`` when idle and back off (:func:`backoff_s`)
    after a failure; once ``finish`` is set, return as without ``watch``. Returns False when
    stopped. ``started``/``finished`` see each step before and after its upload.
    """
    failures = 0
    while not stop.is_set():
        step = source.next_step()
        failed = False
        if step is not None:
            if started is not None:
                started(step)
            r = source.upload_step(step, stop=stop)
            if finished is not None:
                finished(r)
            failed = r.status not in OK
        failures = failures + 1 if failed else 0
        if step is not None and not failed:
            continue
        if not watch or (finish is not None and finish.is_set()):
            return not failed
        _idle(stop, finish, backoff_s(poll_s, failures))
    return False


def _idle(stop: threading.Event, finish: threading.Event | None, seconds: float) -> None:
    """Wait ``seconds`` on ``stop``; with a ``finish`` event (the process's SIGUSR1: a job
    closing after a notice), in short slices so that it does not wait out a whole poll."""
    if finish is None:
        stop.wait(seconds)
        return
    end = time.monotonic() + seconds
    while not stop.is_set() and not finish.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return
        stop.wait(min(left, 0.05))
