"""The uploader as a child process: :class:`UploaderProcess` (the parent's handle) and
:func:`main` (the child, ``python -m tierckpt.uploader``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from tierckpt.tier1 import fs
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.uploads import UPLOAD_LOG
from tierckpt.tier2.uploader.config import OK, UploaderConfig
from tierckpt.tier2.uploader.priority import exit_with_parent, lower_priority
from tierckpt.tier2.uploader.uploader import Uploader


class UploaderProcess:
    """An uploader in a child process (``python -m tierckpt.uploader``) at low priority.

    ``start()`` launches it; ``stop()`` sends SIGINT (the child finishes the file it is
    sending, leaves resumable state, exits) and waits ``timeout_s``, then SIGKILLs;
    ``finish()`` first lets it upload everything due (SIGUSR1), e.g. before a job ends.
    Idempotent; a context manager. The child's output goes to
    ``<tier1>/upload-state/uploader.log``.
    """

    def __init__(self, config: UploaderConfig, *, timeout_s: float = 60.0) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready_r = -1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def argv(self) -> list[str]:
        c = self.config
        return [sys.executable, "-m", "tierckpt.uploader", str(c.tier1), c.tier2, "--watch",
                "--every", str(c.upload_every), "--keep-last", str(c.keep_last),
                "--keep-every", str(c.keep_every), "--poll", str(c.poll_s),
                "--storage-options", json.dumps(dict(c.storage_options)),
                "--parent", str(os.getpid())]

    def start(self) -> UploaderProcess:
        if self._proc is not None:
            return self
        log_dir = Tier1Catalog(self.config.tier1).uploads.upload_state_dir()
        log_dir.mkdir(mode=fs.DEFAULT_DIR_MODE, parents=True, exist_ok=True)
        ready_r, ready_w = os.pipe()  # the child writes one byte once its handlers are set
        try:
            with open(log_dir / UPLOAD_LOG, "ab") as log:
                self._proc = subprocess.Popen(
                    [*self.argv(), "--ready-fd", str(ready_w)], stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, pass_fds=(ready_w,))
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        self._ready_r = ready_r
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait until the child installed its signal handlers (or died), so a signal sent
        next is handled rather than killing it half-started."""
        if self._ready_r < 0:
            return
        select.select([self._ready_r], [], [], timeout_s)
        os.close(self._ready_r)
        self._ready_r = -1

    def poll(self) -> int | None:
        """The child's exit code, or None while it runs (or before start)."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, grace_s: float | None = None) -> int | None:
        """Stop the child (SIGINT, then SIGKILL after ``grace_s``, default ``timeout_s``);
        its exit code. A child stuck in a call to a server that does not answer only ends
        with the SIGKILL; it resumes from its records next time."""
        p = self._proc
        if p is None:
            return None
        grace = self.timeout_s if grace_s is None else grace_s
        if p.poll() is None:
            self._wait_ready(grace)
            p.send_signal(signal.SIGINT)  # a job's uploader ignores SIGTERM: see main()
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._ready_r >= 0:
            os.close(self._ready_r)
            self._ready_r = -1
        return p.returncode

    def finish(self, timeout_s: float | None = None, *,
               stop_grace_s: float | None = None) -> int | None:
        """Ask the child to upload everything due and exit (SIGUSR1); wait up to
        ``timeout_s`` (default ``self.timeout_s``), then :meth:`stop` it with
        ``stop_grace_s``. Returns its exit code: 0 when nothing was left to upload, 1 when
        an upload failed."""
        p = self._proc
        if p is None:
            return None
        if p.poll() is None:
            self._wait_ready(self.timeout_s)
            p.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(self.timeout_s if timeout_s is None else timeout_s)
        return self.stop(stop_grace_s)

    close = stop

    def __enter__(self) -> UploaderProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierckpt.uploader TIER1 TIER2 [--watch]``: drain once (default) or
    watch until SIGTERM/SIGINT (exit 0), or until SIGUSR1 and nothing left to upload (exit 0;
    1 if an upload failed). Without --watch: exit 0 when every attempted upload finished.

    A job's uploader (``--parent``) ignores SIGTERM: that is the termination notice the
    whole process tree gets (torchrun's killpg, Slurm's signal to every process of the
    step), and the job still wants the emergency save it is about to take uploaded. Its rank
    decides: SIGUSR1 (upload what is due, then exit) at close, SIGINT to stop, or its death
    (PDEATHSIG SIGINT, and a watcher thread)."""
    ap = argparse.ArgumentParser(prog="python -m tierckpt.uploader")
    ap.add_argument("tier1", type=Path)
    ap.add_argument("tier2")
    ap.add_argument("--watch", action="store_true")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--keep-every", type=int, default=0)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--storage-options", "--s3-options", dest="storage_options",
                    default="{}")  # --s3-options: the old name, from a running older parent
    ap.add_argument("--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, default=0,
                    help="stop (as on SIGTERM) when this process dies, e.g. a killed rank")
    a = ap.parse_args(argv)
    config = UploaderConfig(tier1=a.tier1, tier2=a.tier2, upload_every=a.every,
                            keep_last=a.keep_last, keep_every=a.keep_every, poll_s=a.poll,
                            storage_options=json.loads(a.storage_options))
    lower_priority()
    stop, finish = threading.Event(), threading.Event()
    relay_signals({signal.SIGTERM: stop, signal.SIGINT: stop, signal.SIGUSR1: finish})
    if a.parent:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        exit_with_parent(a.parent, stop)
    if a.ready_fd >= 0:
        os.write(a.ready_fd, b"1")
        os.close(a.ready_fd)
    with Uploader(config) as up:
        if a.watch:
            return 0 if up.watch(stop, finish) or not finish.is_set() else 1
        return 0 if all(r.status in OK for r in up.drain()) else 1


def relay_signals(targets: dict[int, threading.Event]) -> None:
    """Set ``targets[sig]`` when ``sig`` arrives. The handler only puts the signal number on
    a :class:`queue.SimpleQueue` (reentrant: safe in a handler, even one interrupted by the
    next signal) and a thread sets the event. Setting an Event in the handler takes the
    Event's lock, which the interrupted main thread (in ``Event.set``/``wait``) may already
    hold: a rank's uploader gets two SIGTERMs when torchrun stops the rank (its killpg and
    PDEATHSIG), and the second deadlocked it for good, still holding its lock."""
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()

    def relay() -> None:
        while True:
            targets[pending.get()].set()
    threading.Thread(target=relay, name="tierckpt-signals", daemon=True).start()
    for sig in targets:
        signal.signal(sig, lambda signum, _frame: pending.put(signum))
