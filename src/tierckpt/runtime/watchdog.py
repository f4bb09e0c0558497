"""The step watchdog: turn a silent hang into a prompt, diagnosable exit that torchrun restarts.

A rank that stops making progress (a peer died inside a collective that has no timeout, a
deadlocked data-loader worker, a stuck filesystem) otherwise holds the whole job until some
distant timeout. ``StepWatchdog`` runs one daemon thread; the training loop (or the
``CheckpointManager``) calls ``step_completed(step)`` after every step. If no step completes
within ``hang_timeout`` seconds (counted from ``start()`` for the first step), the thread:

1. writes every thread's Python stack to stderr (``faulthandler.dump_traceback``) and, when an
   event log is given, to ``<event log dir>/hang-rank<rank>-pid<pid>.txt``;
2. emits ``hang_detected`` (seconds_without_step, step = last completed step or None) and
   ``failure_detected`` (how="watchdog", detail);
3. calls ``on_hang(info)`` if given (for tests and custom reporting; its errors are ignored);
4. ends the process with ``os._exit(exit_code)`` (default ``EXIT_CODE`` = 124, as
   ``timeout(1)``: distinct from 75, "preempted, saved") - no cleanup
   handlers run, because a hung process may never get through them - so the torchrun agent
   sees a failed worker and restarts the group.

The first ``step_completed`` of the process also emits ``first_step``
(seconds_since_process_start), the last point of the restart timeline (R ends there).

``close()`` stops the thread and joins it; it is idempotent and also runs on ``__exit__``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierckpt.errors import ConfigError
from tierckpt.runtime.events import (
    FAILURE_DETECTED,
    HANG_DETECTED,
    EventLog,
    ProgressMarks,
)
from tierckpt.runtime.steps import emit_first_step

__all__ = ["EXIT_CODE", "HangInfo", "StepWatchdog"]

EXIT_CODE = 124
"""Exit status of a process ended by the watchdog (EX_TEMPFAIL: worth a restart)."""


@dataclass(frozen=True)
class HangInfo:
    """What the watchdog saw when it fired."""

    last_step: int | None
    seconds_without_step: float
    stacks_path: str | None


class StepWatchdog:
    """Exit the process when no training step completes within ``hang_timeout`` seconds.

    Use as a context manager (``start()`` on enter, ``close()`` on exit) or call them
    yourself. ``event_log`` is an ``EventLog`` or a path; a path is opened here and closed by
    ``close()``. ``rank`` labels the stack file (defaults to the event log's rank, else
    ``RANK`` from the environment). ``exit_code`` must be non-zero.
    """

    def __init__(
        self,
        hang_timeout: float,
        *,
        on_hang: Callable[[HangInfo], object] | None = None,
        event_log: EventLog | str | os.PathLike[str] | None = None,
        exit_code: int = EXIT_CODE,
        rank: int | None = None,
    ) -> None:
        if isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float)) \
                or not hang_timeout > 0:
            raise ConfigError(f"hang_timeout must be a positive number of seconds, "
                              f"got {hang_timeout!r}")
        if not isinstance(exit_code, int) or not 0 < exit_code < 256:
            raise ConfigError(f"exit_code must be in 1..255 so torchrun sees a failure, "
                              f"got {exit_code!r}")
        if on_hang is not None and not callable(on_hang):
            raise ConfigError(f"on_hang must be callable, got {on_hang!r}")
        self.hang_timeout = float(hang_timeout)
        self._on_hang = on_hang
        self._exit_code = exit_code
        self._owns_log = False
        if event_log is None or isinstance(event_log, EventLog):
            self._log = event_log
        elif isinstance(event_log, (str, os.PathLike)):
            self._log = EventLog(event_log, rank=rank if rank is not None else _env_rank())
            self._owns_log = True
        else:
            raise ConfigError(f"event_log must be an EventLog or a path, got {event_log!r}")
        if rank is None:
            rank = self._log.rank if self._log is not None else _env_rank()
        self.rank = rank
        self._cond = threading.Condition()
        self._last_progress = time.monotonic()
        self._last_step: int | None = None
        self._first_step_pending = True
        self._marks = None if self._log is None else ProgressMarks(self._log)
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> StepWatchdog:
        """Start watching; the first step must complete within ``hang_timeout`` from now."""
        with self._cond:
            if self._stopping:
                raise ConfigError("StepWatchdog was closed; create a new one")
            if self._thread is not None:
                return self
            self._last_progress = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="tierckpt-step-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching and join the thread. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._owns_log and self._log is not None:
            self._log.close()
            self._owns_log = False

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- progress ------------------------------------------------------------------------------

    def step_completed(self, step: int) -> None:
        """Record that ``step`` finished; resets the hang clock. Cheap; call every step."""
        with self._cond:
            self._last_step = step
            self._last_progress = time.monotonic()
            first, self._first_step_pending = self._first_step_pending, False
        if self._marks is not None:
            self._marks.step(step)
        if first and self._log is not None:
            emit_first_step(self._log, step)

    def heartbeat(self) -> None:
        """Reset the hang clock without claiming a step, e.g. before a known long operation
        such as a restore, so it is not taken for a hang."""
        with self._cond:
            self._last_progress = time.monotonic()

    @property
    def last_step(self) -> int | None:
        """The last step reported by ``step_completed``, or None."""
        return self._last_step

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        with self._cond:
            while not self._stopping:
                idle = time.monotonic() - self._last_progress
                if idle >= self.hang_timeout:
                    break
                self._cond.wait(self.hang_timeout - idle)
            if self._stopping:
                return
            last_step = self._last_step
        self._fire(last_step, idle)

    def _fire(self, last_step: int | None, idle: float) -> None:
        detail = (f"no training step completed for {idle:.1f}s (hang_timeout "
                  f"{self.hang_timeout:g}s); last completed step: {last_step}")
        sys.stderr.write(f"tierckpt watchdog (rank {self.rank}, pid {os.getpid()}): {detail}; "
                         "dumping all thread stacks and exiting\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        stacks_path = self._dump_to_file()
        if self._log is not None:
            self._log.emit(HANG_DETECTED, step=last_step, seconds_without_step=idle,
                           stacks=stacks_path)
            self._log.emit(FAILURE_DETECTED, step=last_step, how="watchdog", detail=detail)
        if self._on_hang is not None:
            # Reporting must never stop the exit below.
            with contextlib.suppress(Exception):
                self._on_hang(HangInfo(last_step, idle, stacks_path))
        sys.stderr.flush()
        os._exit(self._exit_code)

    def _dump_to_file(self) -> str | None:
        if self._log is None:
            return None
        path = Path(self._log.path).parent / f"hang-rank{self.rank}-pid{os.getpid()}.txt"
        try:
            with open(path, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            return None
        return str(path)


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
