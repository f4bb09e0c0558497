"""Workers that outlive their launcher stop themselves.

torchrun starts each worker in a session of its own, so killing only the launcher's process
group (``kill -9 -<pgid>``, a scheduler that signals one process group, an OOM killer that
takes the agent) leaves the ranks running: they go on training and writing to the same
tier-1 root as orphans, next to the job that replaces them. :func:`watch_launcher` starts a
daemon thread that notices when the parent (the agent) is gone — the worker was re-parented
— logs ``launcher_lost`` and sends this process ``SIGTERM`` (a handler, e.g. a preemption
save, still runs), then ``SIGKILL`` after ``grace_s`` if it is still alive.

``TIERCKPT_ORPHANS=keep`` turns it off (a worker meant to outlive its launcher);
``TIERCKPT_ORPHANS=kill`` sends ``SIGKILL`` at once, no notice: what a multi-node
``tierckpt run`` sets, since a spare node takes the ranks of a node whose supervisor is gone
and an orphan must not run on beside its replacement (:mod:`tierckpt.heal.nodes`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from tierckpt.runtime import events

_log = logging.getLogger("tierckpt")

ENV = "TIERCKPT_ORPHANS"
POLL_S = 1.0
GRACE_S = 30.0


def watch_launcher(log_path: str | os.PathLike[str] | None = None, *, poll_s: float = POLL_S,
                   grace_s: float = GRACE_S) -> threading.Thread | None:
    """Start the watch (once per process) when running under torchrun and not turned off;
    the thread, or None when not started."""
    if os.environ.get(ENV) == "keep" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()
    if parent <= 1:
        return None
    t = threading.Thread(target=_watch, args=(parent, log_path, poll_s, grace_s),
                         name="tierckpt-launcher-watch", daemon=True)
    t.start()
    return t


def _watch(parent: int, log_path: str | os.PathLike[str] | None, poll_s: float,
           grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _log.error("the launcher (pid %d) is gone: this worker stops itself (%s=keep to keep "
               "orphans running)", parent, ENV)
    if log_path is not None:
        try:
            with events.EventLog(log_path, rank=int(os.environ.get("RANK", "0"))) as log:
                log.emit(events.LAUNCHER_LOST, parent_pid=parent)
        except OSError:
            pass
    if os.environ.get(ENV) == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
