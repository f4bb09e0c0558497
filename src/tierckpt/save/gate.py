"""When a save's staging is over: the gate between background copies and the training loop.

With ``staging="overlap"`` a ``save()`` returns while parameters and optimizer state are
still being copied to host memory (:mod:`tierckpt.save.staging`). They change only in
``optimizer.step()``, so :class:`StagingGate` registers a step pre-hook on the state's
optimizer that waits for the copy to land — training blocks only if the copy outlasts the
forward and backward pass. The next ``save()``, ``wait()``, ``restore()`` and ``close()``
wait for it too. ``staging="sync"`` goes through the same gate with nothing left to wait for.

The gate emits ``save_staged`` once per save, when staging is over: ``seconds`` is the time
training was blocked (``save()`` itself plus any wait in the hook: this is C),
``copy_seconds`` how long the background copies ran, ``deferred_bytes`` what they moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from tierckpt.runtime import events


@dataclasses.dataclass
class _Pending:
    step: int
    blocked_s: float
    nbytes: int
    deferred_bytes: int
    ready: Future[float]
    staged: Future[float]


class StagingGate:
    """At most one staging in flight; thread-safe (a hook may run on any thread)."""

    def __init__(self, log: events.EventLog) -> None:
        self.log = log
        self._pending: _Pending | None = None
        self._lock = threading.Lock()
        self._hooks: dict[int, tuple[torch.optim.Optimizer, RemovableHandle]] = {}
        self.on_step: Callable[[], None] | None = None
        """Called at every ``optimizer.step()`` of a watched optimizer, before anything
        else (the manager marks steps with it for :mod:`tierckpt.runtime.save_cost` when
        the loop does not call ``should_save()``)."""

    def watch(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Make ``optimizer.step()`` wait for staging and call ``on_step`` (once per
        optimizer; None: nothing to watch)."""
        if optimizer is None or id(optimizer) in self._hooks:
            return
        handle = optimizer.register_step_pre_hook(self._before_step)
        self._hooks[id(optimizer)] = (optimizer, handle)

    def begin(self, *, step: int, blocked_s: float, nbytes: int, deferred_bytes: int,
              ready: Future[float], staged: Future[float]) -> None:
        """A save staged ``nbytes`` (``deferred_bytes`` still copying until ``ready``);
        ``staged`` is the handle's future, resolved here with the blocked seconds."""
        pending = _Pending(step, blocked_s, nbytes, deferred_bytes, ready, staged)
        with self._lock:
            assert self._pending is None, "settle() the previous staging first"
            self._pending = pending
        ready.add_done_callback(lambda _: self._landed(pending))

    def settle(self) -> None:
        """Wait until the pending staging (if any) is over and record it. Never raises: a
        failed background copy fails the save itself (the saver waits on ``ready`` too)."""
        with self._lock:
            p, self._pending = self._pending, None
            if p is None:
                return
            t0 = time.monotonic()
            with contextlib.suppress(BaseException):
                p.ready.exception()  # waits; the error itself is the saver's to report
            self._record(p, p.blocked_s + (time.monotonic() - t0))

    def _landed(self, p: _Pending) -> None:
        """The copies landed before anyone waited for them: nothing more was blocked."""
        with self._lock:
            if self._pending is not p:
                return  # settled (or being settled) by a waiter
            self._pending = None
            self._record(p, p.blocked_s)

    def _record(self, p: _Pending, blocked: float) -> None:
        p.staged.set_result(blocked)
        failed = p.ready.exception() is not None
        copy_s = None if failed else p.ready.result()
        extra: dict[str, Any] = {}
        if p.deferred_bytes:
            extra = {"deferred_bytes": p.deferred_bytes, "copy_seconds": copy_s}
        self.log.emit(events.SAVE_STAGED, step=p.step, seconds=blocked, bytes=p.nbytes,
                      **extra)

    def close(self) -> None:
        """Settle, and remove the hooks. Idempotent."""
        self.settle()
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.on_step is not None:
            self.on_step()
        if self._pending is not None:
            self.settle()
