"""Notice signals: handlers that only record, and that keep a script's old behaviour until it
opts in.

:class:`SignalNotices` installs one handler per configured signal (main thread only: Python
allows nothing else) when it is armed (:meth:`SignalNotices.arm`, by the first
``CheckpointManager.should_stop()`` call). Until then nothing is installed and a signal does
exactly what it did before tierckpt: the previous Python handler runs, or the default
action, or nothing if it was ignored. Not installing matters: the kernel's default action
ends a process at once, while a Python handler runs only when the main thread is back in
the interpreter — a rank blocked in a collective of a dead peer ignored torchrun's SIGTERM
until the group's timeout (34.6 s of a 41.7 s restart, world 4, in ``bench.heal``). So a
script that never asks about preemption keeps today's SIGTERM behaviour, and a kill never
turns into a hang or a wait. (:meth:`SignalNotices.install` alone installs unarmed handlers
that do the previous behaviour.) Once armed, the handler
posts a :class:`~tierckpt.preempt.notice.Notice` to the box and returns: no lock, no I/O, no
save in the handler (the watcher thread and the loop do the work). Repeats are counted,
never acted on twice (Slurm and torchrun can each deliver the same SIGTERM). Torch-free.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from tierckpt.preempt.notice import Notice, NoticeBox

_log = logging.getLogger("tierckpt")

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalNotices:
    """Handlers for ``signals`` posting to ``box`` with a deadline of ``grace_s`` after
    receipt. :meth:`install` (idempotent; a no-op off the main thread, logged) and
    :meth:`uninstall` (puts the previous handlers back)."""

    def __init__(self, box: NoticeBox, signals: tuple[int, ...], *, grace_s: float) -> None:
        self.box, self.signals, self.grace_s = box, signals, grace_s
        self.armed = False
        """Set by the first ``should_stop()``: from then on a signal is a notice."""
        self.installed = False
        self._previous: dict[int, Handler] = {}

    def arm(self) -> bool:
        """From now on a signal is a notice: install the handlers (see :meth:`install`) and
        arm them; False when they could not be installed (off the main thread)."""
        self.armed = True
        return self.install()

    def install(self) -> bool:
        """Install the handlers; False (and nothing installed) off the main thread."""
        if self.installed or not self.signals:
            return self.installed
        if threading.current_thread() is not threading.main_thread():
            _log.info("preemption signals %s not watched: the manager was built off the main "
                      "thread (use a trigger file or a poller instead)", self._names())
            return False
        for s in self.signals:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._on_signal)
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Put the previous handlers back (main thread; idempotent)."""
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        for s, h in self._previous.items():
            if signal.getsignal(s) == self._on_signal:
                signal.signal(s, h if h is not None else signal.SIG_DFL)
        self.installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            name = signal.Signals(signum).name
            self.box.post(Notice.now(f"signal:{name}", grace_s=self.grace_s))
            return
        self._previous_behaviour(signum, frame)

    def _previous_behaviour(self, signum: int, frame: FrameType | None) -> None:
        """What the signal did before tierckpt: the old handler, or the default action."""
        prev = self._previous.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or None: a handler not installed from Python)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _names(self) -> str:
        return ", ".join(signal.Signals(s).name for s in self.signals)
