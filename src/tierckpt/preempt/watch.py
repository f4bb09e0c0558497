"""The step every rank stops at, agreed through the job's store with no per-step collective.

A notice may reach one rank only (one pod's SIGTERM, one node's metadata server) or every
rank at a different step. Each rank runs one :class:`StopWatch` thread that:

1. asks the pollers that are due (trigger file, cloud metadata) and reads the
   :class:`~tierckpt.preempt.notice.NoticeBox` (signals post there);
2. publishes the first local notice under ``<key>/notice`` (the first writer wins), or
   adopts one another rank published (source ``rank:<r>``);
3. once a notice is known, *reports* this rank's progress — the highest step the loop has
   reached a check at — raising ``<key>/max`` to it (compare-and-set) and counting itself
   in ``<key>/reported``;
4. when all ``world_size`` ranks reported, the *target* is ``max + 1``.

Why ``max + 1`` is reachable by every rank and passed by none: a lockstep job's ranks are
at most one step apart, and the loop blocks at any check made after this rank knows of the
notice until the target is known (:meth:`StopWatch.wait_target`). A rank that reported ``r``
has passed at most the check of step ``r``; the target is at least ``r + 1``. The wait is
short (every watcher reports within a poll), and it costs the loop nothing before a notice.

Cost before a notice: the watcher thread checks the notice key every
``max(poll_s, world_size / STORE_OPS_PER_S)`` seconds on its own connection — the store
server sees at most :data:`STORE_OPS_PER_S` checks per second from the whole job, whatever
its size (50 ms at 2 ranks, 2 s at 4,096) — and the training thread reads two attributes per
check. A local notice is published by the training thread at its next check (through a
second connection). (A blocking ``wait`` on the key would cost the server nothing, but each
timeout of it logs a c10d warning: one per rank per second.) Torch-free: the store is any
object with ``check``, ``get``, ``compare_set``, ``add`` and ``clone`` (a
``torch.distributed.Store`` clone).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tierckpt.preempt.config import Poller
from tierckpt.preempt.notice import Notice, NoticeBox
from tierckpt.runtime import events

_log = logging.getLogger("tierckpt")

STORE_OPS_PER_S = 2000
"""The most notice-key checks per second the whole job sends the store before a notice."""


class Store(Protocol):
    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def clone(self) -> Store: ...


class StopWatch:
    """One rank's watcher (see the module docstring). ``store`` None: a single process,
    whose target is the step of its first check after the notice. ``margin_s``: the
    agreement is given up ``margin_s`` before the notice's deadline (:attr:`error` says
    which ranks did not report)."""

    def __init__(self, box: NoticeBox, *, store: Store | None, rank: int, world_size: int,
                 key: str, poll_s: float, pollers: Sequence[Poller] = (),
                 log: events.EventLog | None = None, margin_s: float = 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.box, self.store, self.rank, self.world_size = box, store, rank, world_size
        self.key, self.poll_s, self.pollers, self.log = key, poll_s, tuple(pollers), log
        self.margin_s, self.clock = margin_s, clock
        self.idle_s = max(poll_s, world_size / STORE_OPS_PER_S)
        """Seconds between checks of the notice key before a notice."""
        multi = store is not None and world_size > 1
        self._publisher = store.clone() if multi and store is not None else None
        """The training thread's own connection: it publishes a local notice at once."""
        self._lock = threading.Lock()  # adopting a notice: the watcher or the loop
        self.progress = -1
        """The highest step the loop reached a check at (written by the training thread)."""
        self.notice: Notice | None = None
        """The notice this rank acts on (its own, or another rank's)."""
        self.reported: int | None = None
        self.target: int | None = None
        self.error: str | None = None
        self._settled = threading.Event()  # target known, or the agreement failed
        self._stop = threading.Event()
        self._next_poll = [0.0] * len(self.pollers)
        self._warned: set[tuple[str, str]] = set()
        self._thread: threading.Thread | None = None

    # -- the training thread ----------------------------------------------------------
    def start(self) -> StopWatch:
        self._thread = threading.Thread(target=self._run, name="tierckpt-stopwatch",
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def noticed(self) -> bool:
        """A notice is known here (cheap: the loop's per-step test)."""
        return self.notice is not None or self.box.first is not None

    def _publish_from_loop(self) -> None:
        """The training thread: a local notice is published now (its watcher may be
        checking only every ``idle_s``); the other watchers see it at their next check."""
        if self._publisher is None or self.notice is not None or self.box.first is None:
            return
        with self._lock:
            if self.notice is None:
                try:
                    self._adopt_local(self._publisher)
                except Exception as e:
                    if not _store_lost(e):
                        raise
                    self._fail(f"the job's store is gone ({e}): the launcher that hosted it "
                               "died or cannot be reached, so no stop step can be agreed")

    def wait_target(self, step: int) -> int | None:
        """The agreed step, waiting for it when a notice is known; None: no notice, or the
        agreement failed (:attr:`error`). A single process stops at ``step``."""
        if not self.noticed:
            return None
        if self.store is None or self.world_size == 1:
            if self.notice is None:
                self._adopt_local()
            if self.target is None:
                self.target = step
                self._settled.set()
            return self.target
        self._publish_from_loop()
        while not self._settled.wait(self.poll_s):
            if self._thread is None or not self._thread.is_alive():
                self._tick()  # no thread (tests, or it died): do its work here
        return self.target

    def arrive(self, name: str) -> None:
        """Count this rank in ``<key>/<name>`` (the training thread's connection), for
        :meth:`wait_arrived`. Nothing in a single process. Store errors propagate."""
        store = self._publisher or self.store
        if store is not None and self.world_size > 1:
            store.add(self._k(name), 1)

    def wait_arrived(self, name: str, timeout_s: float) -> int:
        """Wait until every rank has :meth:`arrive`-d at ``name``, at most ``timeout_s``
        seconds; the count seen last (``world_size`` in a single process)."""
        store = self._publisher or self.store
        if store is None or self.world_size == 1:
            return self.world_size
        end = time.monotonic() + timeout_s
        while True:
            count = store.add(self._k(name), 0)
            if count >= self.world_size or time.monotonic() >= end:
                return count
            time.sleep(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(2.0, 4 * self.poll_s))

    # -- the watcher thread -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set() and not self._settled.is_set():
            try:
                self._tick()
                self._stop.wait(self.poll_s if self.noticed else self._idle())
            except Exception as e:
                if _store_lost(e):  # every further call would fail (and print torch's C++ stack)
                    self._fail(f"the job's store is gone ({e}): the launcher that hosted it "
                               "died or cannot be reached, so no stop step can be agreed")
                    return
                self._warn("store", e)
                if self.notice is not None and self.store is not None:
                    self._fail(f"the job's store failed during the agreement: {e}")
                self._stop.wait(self.poll_s)

    def _idle(self) -> float:
        """The wait before the next look: ``idle_s``, or less when a poller is due."""
        due = min((t - time.monotonic() for t in self._next_poll), default=self.idle_s)
        return max(self.poll_s, min(self.idle_s, due))

    def _tick(self) -> None:
        self._ask_pollers()
        with self._lock:
            if self.notice is None:
                if self.box.first is not None:
                    self._adopt_local()
                elif self.store is not None and self.store.check([self._k("notice")]):
                    self._adopt_remote()
        if self.notice is None or self.store is None or self.world_size == 1:
            return
        if self.reported is None:
            self._report()
        count = self.store.add(self._k("reported"), 0)
        if count >= self.world_size:
            self.target = int(self.store.get(self._k("max")).decode()) + 1
            self._settled.set()
            _log.warning("preemption: all %d ranks agreed to stop after step %d and save it",
                         self.world_size, self.target)
        elif self.notice.remaining_s(self.clock()) < self.margin_s:
            self._fail(f"{self.world_size - count} of {self.world_size} ranks did not report "
                       f"their step before the notice's deadline (a rank is dead or hung)")

    def _ask_pollers(self) -> None:
        now = time.monotonic()
        for i, p in enumerate(self.pollers):
            if now < self._next_poll[i]:
                continue
            self._next_poll[i] = now + p.every_s
            try:
                notice = p.poll()
            except Exception as e:
                self._warn(p.name, e)
                continue
            if notice is not None:
                self.box.post(notice)

    def _adopt_local(self, store: Store | None = None) -> None:
        notice = self.box.first
        assert notice is not None
        self.notice = notice
        self._emit(notice)
        store = store or self.store
        if store is not None and self.world_size > 1:
            body = json.dumps({**notice.to_json(), "rank": self.rank})
            store.compare_set(self._k("notice"), "", body)  # the first writer wins

    def _adopt_remote(self) -> None:
        assert self.store is not None
        d: dict[str, Any] = json.loads(self.store.get(self._k("notice")).decode())
        first = Notice.from_json(d)
        self.notice = Notice(source=f"rank:{d.get('rank')}", received_unix=self.clock(),
                             deadline_unix=first.deadline_unix, detail=first.source)
        self.box.post(self.notice)
        self._emit(self.notice)

    def _report(self) -> None:
        assert self.store is not None
        mine, expected = self.progress, ""
        while True:  # raise <key>/max to at least mine
            now = self.store.compare_set(self._k("max"), expected, str(mine)).decode()
            if now and int(now) >= mine:
                break
            expected = now
        self.reported = mine
        self.store.add(self._k("reported"), 1)

    def _fail(self, why: str) -> None:
        if not self._settled.is_set():
            self.error = why
            _log.error("preemption: %s; no emergency save", why)
            self._settled.set()

    def _emit(self, notice: Notice) -> None:
        if self.log is not None:
            # step: where this rank's loop was when it learned of the notice (the drills
            # bound the agreed step by it; the sender's view of the log lags under load)
            self.log.emit(events.PREEMPT_NOTICE, **notice.to_json(), step=self.progress)
        what = ("stopping after this step and saving it" if self.world_size == 1 else
                "agreeing with the other ranks on a step to stop at and save")
        _log.warning("termination notice (%s): %.1f s before the expected kill; %s",
                     notice.source, notice.remaining_s(self.clock()), what)

    def _warn(self, name: str, e: BaseException) -> None:
        key = (name, type(e).__name__)
        if key not in self._warned:
            self._warned.add(key)
            _log.warning("preemption watcher: %s failed (%s: %s); still watching", name,
                         type(e).__name__, e)

    def _k(self, name: str) -> str:
        return f"{self.key}/{name}"


def _store_lost(e: BaseException) -> bool:
    """The job's store (hosted by the torchrun agent) is unreachable for good: its
    connection was refused or reset, not a slow answer."""
    return type(e).__name__ == "DistNetworkError" or isinstance(e, ConnectionError)
