"""The tier-2 promoter: copies committed tier-1 checkpoints to object storage, verified.

It runs as its own low-priority process (``nice`` 19, idle I/O class), one per tier-1 root
(a per-root lock enforces it): :class:`UploaderProcess` starts one from the library, and
``python -m tierckpt.uploader TIER1 TIER2`` runs one alone. :class:`Uploader` is the same
logic in-process.

Per checkpoint, in this order (:meth:`Uploader.upload_step`):

1. pin it on tier 1 (``pins/step-XXXXXXXX.upload``) so retention keeps it;
2. verify its marker against its manifest; stop if tier 2 already has a marker (the same
   bytes: done; different bytes: a conflict, nothing is touched);
3. abort this root's stale multipart uploads of its files, then upload each file of the
   manifest that this root holds, with the manifest's CRC32C as the object's full-object
   checksum (end to end: the server checks the bytes computed at write time); a file
   whose object already matches (size and CRC32C) is skipped, so a restart resumes;
4. HEAD every file of the manifest: if another node's files are still missing, record
   ``files_verified`` and stop (that node's uploader writes the marker when it finishes);
5. upload ``manifest.json``, verify it, then ``COMPLETE`` last with a create-only write;
6. record ``verified``, unpin, apply tier-2 retention.

A crash at any point leaves no marker over unverified objects; a restart redoes the step.

Upload state, per step, in ``<tier1>/upload-state/step-XXXXXXXX.json`` (written durably)::

    {"step": int, "save_id": str, "tier2": url, "status": STATUS, "bytes": int,
     "seconds": float, "updated_unix": float, "error": str (failed/conflict only)}

``STATUS`` is ``uploading``, ``files_verified`` (this root's files are on tier 2, the
marker waits for other nodes), ``verified`` (marker written and checked), ``failed`` (will
be retried) or ``conflict`` (tier 2 holds a different checkpoint for the step; never
retried). :func:`uploaded_steps` is what tier-1 retention needs: with
:func:`tierckpt.policy.retention.tier1_upload_holds` it tells which steps must stay on tier 1.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import platform
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tierckpt.errors import CheckpointError, ConfigError, IntegrityError, LockError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.policy import retention
from tierckpt.runtime import events
from tierckpt.tier1 import fs
from tierckpt.tier1.commit import complete_steps
from tierckpt.tier2.storage import ObjectExistsError, ObjectInfo, Storage, open_storage

HOLDER = "upload"
DONE = frozenset({"verified", "files_verified", "conflict"})
_OK = DONE | {"gone"}  # "gone": deleted from tier 1 before it could be pinned (not an error)
MAX_BACKOFF_S = 300.0
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "arm64": 31}


@dataclasses.dataclass(frozen=True, kw_only=True)
class UploaderConfig:
    """What to upload, where, and tier-2 retention."""

    tier1: Path
    """The tier-1 root this uploader serves (one uploader per root)."""
    tier2: str
    """``s3://bucket/prefix`` or ``file:///path`` (see
    :func:`tierckpt.tier2.storage.open_storage`)."""
    upload_every: int = 1
    """Upload every Nth committed step (step % N == 0); 1 uploads every step."""
    keep_last: int = 3
    """Tier-2 retention: newest complete checkpoints kept."""
    keep_every: int = 0
    """Tier-2 retention: steps that are multiples of this are kept forever (0: none)."""
    poll_s: float = 2.0
    """Seconds between looks at tier 1 when idle."""
    s3_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """:class:`tierckpt.tier2.storage.s3.S3Config` fields for ``s3://`` tier 2."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier1", Path(self.tier1))
        if self.upload_every < 1:
            raise ConfigError(f"upload_every must be >= 1 (1 = every step), got "
                              f"{self.upload_every}")
        if self.keep_last < 1:
            raise ConfigError(f"tier-2 keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every < 0:
            raise ConfigError(f"tier-2 keep_every must be >= 0 (0 = off), got {self.keep_every}")
        if self.poll_s <= 0:
            raise ConfigError(f"poll_s must be > 0 seconds, got {self.poll_s}")


@dataclasses.dataclass(frozen=True)
class UploadResult:
    """Outcome of one :meth:`Uploader.upload_step`. ``bytes`` were sent this time."""

    step: int
    status: str
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


# -- upload state on tier 1 ------------------------------------------------------------------
def state_path(tier1: Path, step: int) -> Path:
    return Path(tier1) / layout.UPLOAD_STATE / f"{layout.step_dirname(step)}.json"


def read_state(tier1: Path, step: int) -> dict[str, Any] | None:
    """The recorded upload state of ``step`` or None (missing or unreadable)."""
    try:
        d = json.loads(state_path(tier1, step).read_bytes())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _write_state(tier1: Path, step: int, **fields: Any) -> None:
    path = state_path(tier1, step)
    path.parent.mkdir(mode=fs.DEFAULT_DIR_MODE, exist_ok=True)
    body = {"step": step, "updated_unix": time.time(), **fields}
    fs.write_durably(path, json.dumps(body, sort_keys=True).encode() + b"\n")


def upload_states(tier1: Path) -> dict[int, dict[str, Any]]:
    """Every recorded upload state under ``tier1``, by step."""
    out: dict[int, dict[str, Any]] = {}
    d = Path(tier1) / layout.UPLOAD_STATE
    if not d.is_dir():
        return out
    for name in os.listdir(d):
        step = layout.parse_step_dirname(name.removesuffix(".json"))
        if step is not None and name.endswith(".json"):
            st = read_state(Path(tier1), step)
            if st is not None:
                out[step] = st
    return out


def uploaded_steps(tier1: Path) -> set[int]:
    """Steps whose upload is done (verified, files_verified or conflict): tier-1 retention
    may delete them as far as the uploader is concerned."""
    return {s for s, st in upload_states(tier1).items() if st.get("status") in DONE}


# -- tier 2 helpers ---------------------------------------------------------------------------
def remote_complete_steps(storage: Storage) -> list[int]:
    """Steps with a ``COMPLETE`` object on tier 2 (unverified), ascending."""
    steps = []
    for info in storage.list("step-"):
        head, _, tail = info.key.partition("/")
        step = layout.parse_step_dirname(head)
        if step is not None and tail == layout.COMPLETE:
            steps.append(step)
    return sorted(steps)


def delete_remote(storage: Storage, step: int) -> None:
    """Delete a tier-2 checkpoint: its marker first, so a crash mid-delete never leaves a
    marker over missing objects; then everything else under its prefix."""
    base = layout.step_dirname(step)
    storage.delete(f"{base}/{layout.COMPLETE}")
    for info in storage.list(f"{base}/"):
        storage.delete(info.key)


def _matches(info: ObjectInfo | None, f: mf.FileEntry) -> bool:
    return info is not None and info.size == f.size and info.crc32c == f.crc32c


# -- process priority -------------------------------------------------------------------------
def lower_priority() -> dict[str, bool]:
    """Make this process nice 19 and idle I/O class (best effort; returns what applied)."""
    applied = {"nice": False, "ioprio": False}
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))
        applied["nice"] = True
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is not None and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        # ioprio_set(IOPRIO_WHO_PROCESS=1, pid 0 = self, class IDLE << 13)
        applied["ioprio"] = libc.syscall(nr, 1, 0, _IOPRIO_CLASS_IDLE << 13) == 0
    return applied


def io_priority(pid: int = 0) -> int | None:
    """``ioprio_get`` of ``pid`` (0 = self): ``class << 13 | level``; None if unavailable."""
    nr = _IOPRIO_GET.get(platform.machine())
    if nr is None or not sys.platform.startswith("linux"):
        return None
    value = int(ctypes.CDLL(None, use_errno=True).syscall(nr, 1, pid))
    return None if value < 0 else value


IOPRIO_IDLE = _IOPRIO_CLASS_IDLE << 13


class _Stopped(Exception):
    pass


class Uploader:
    """Uploads committed tier-1 checkpoints per :class:`UploaderConfig`. Context manager.

    Holds ``<tier1>/upload-state/.lock`` (flock) while open, so a second uploader on the
    same root fails with :class:`LockError`. On open it removes its own stale pins (left
    by a killed predecessor).
    """

    def __init__(self, config: UploaderConfig, *, storage: Storage | None = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        self._progress = progress
        self._closed = False
        state_dir = config.tier1 / layout.UPLOAD_STATE
        state_dir.mkdir(mode=fs.DEFAULT_DIR_MODE, parents=True, exist_ok=True)
        self._lock_fd = os.open(state_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                0o640)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise LockError(f"another uploader is running for {config.tier1}") from None
        try:
            self.storage = storage if storage is not None else open_storage(
                config.tier2, **config.s3_options)
            self.log = events.EventLog(config.tier1 / layout.EVENTS)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._remove_stale_pins()

    def _remove_stale_pins(self) -> None:
        pins = self.config.tier1 / layout.PINS
        if pins.is_dir():
            for name in os.listdir(pins):
                if name.endswith(f".{HOLDER}") and layout.parse_pin_filename(name) is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(pins / name)

    def close(self) -> None:
        """Release the storage client, event log and lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.storage.close()
        self.log.close()
        os.close(self._lock_fd)

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- policy ---------------------------------------------------------------------------
    def next_step(self) -> int | None:
        """The step to upload next (see :func:`tierckpt.policy.retention.next_upload`)."""
        return retention.next_upload(complete_steps(self.config.tier1),
                                     upload_every=self.config.upload_every,
                                     done=uploaded_steps(self.config.tier1))

    def run_once(self, stop: threading.Event | None = None) -> UploadResult | None:
        """Upload the next due step, if any; return its result (None when idle)."""
        step = self.next_step()
        return None if step is None else self.upload_step(step, stop=stop)

    def drain(self) -> list[UploadResult]:
        """Upload until nothing is due or an upload does not finish; return the results."""
        results: list[UploadResult] = []
        while (r := self.run_once()) is not None:
            results.append(r)
            if r.status not in _OK:
                break
        return results

    def watch(self, stop: threading.Event, finish: threading.Event | None = None) -> bool:
        """Upload due steps until ``stop`` is set (checked between files), polling tier 1
        every ``poll_s`` when idle and backing off after a failure. Once ``finish`` is set,
        return as soon as nothing is due (True) or an upload fails (False)."""
        failures = 0
        while not stop.is_set():
            r = self.run_once(stop)
            failed = r is not None and r.status not in _OK
            if (r is None or failed) and finish is not None and finish.is_set():
                return r is None
            failures = failures + 1 if failed else 0
            if r is None or failed:  # idle, or back off exponentially while failing
                stop.wait(min(self.config.poll_s * 2 ** min(failures, 10), MAX_BACKOFF_S))
        return False

    # -- one checkpoint -------------------------------------------------------------------
    def upload_step(self, step: int, *, stop: threading.Event | None = None) -> UploadResult:
        """Copy the committed checkpoint of ``step`` to tier 2 (module docstring order).
        Failures are recorded (state ``failed``, event ``upload_failed``) and returned,
        not raised: the uploader retries on its next pass."""
        root = self.config.tier1
        pin = root / layout.PINS / layout.pin_filename(step, HOLDER)
        pin.parent.mkdir(mode=fs.DEFAULT_DIR_MODE, exist_ok=True)
        fs.write_durably(pin, b"")
        t0 = time.monotonic()
        try:
            return self._upload_pinned(step, t0, stop)
        except _Stopped:
            return UploadResult(step, "stopped", seconds=time.monotonic() - t0)
        except (CheckpointError, OSError) as e:
            err = f"{type(e).__name__}: {e}"
            _write_state(root, step, status="failed", error=err, tier2=self.storage.url)
            self.log.emit(events.UPLOAD_FAILED, step=step, error=err, source="uploader")
            return UploadResult(step, "failed", seconds=time.monotonic() - t0, error=err)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pin)

    def _upload_pinned(self, step: int, t0: float, stop: threading.Event | None) -> UploadResult:
        root, st = self.config.tier1, self.storage
        ckpt = root / layout.step_dirname(step)
        try:
            manifest_bytes = (ckpt / layout.MANIFEST).read_bytes()
            marker = (ckpt / layout.COMPLETE).read_bytes()
        except FileNotFoundError:
            return UploadResult(step, "gone")  # deleted before the pin took hold
        m = mf.verify_marker(marker, manifest_bytes, key=mf.signing_key())
        key = lambda name: layout.object_key("", step, name)  # noqa: E731
        base = {"save_id": m.save_id, "tier2": st.url}

        remote_marker = self._remote_marker(key(layout.COMPLETE))
        if remote_marker is not None:
            return self._already_there(step, remote_marker == marker, base, t0)

        own = [f for f in m.files if (ckpt / f.name).exists()]
        for f in own:
            if (size := (ckpt / f.name).stat().st_size) != f.size:
                raise IntegrityError(f"tier-1 {ckpt.name}/{f.name} has {size} bytes, manifest "
                                     f"says {f.size}; not uploading a damaged checkpoint")
        total = sum(f.size for f in own)
        _write_state(root, step, status="uploading", bytes=total, **base)
        self.log.emit(events.UPLOAD_STARTED, step=step, bytes=total, source="uploader")
        for f in own:
            if f.rank is not None:  # shared files may be in flight from another node
                st.abort_uploads(key(f.name))
        sent = done = 0
        for f in own:
            if stop is not None and stop.is_set():
                raise _Stopped
            if not _matches(st.head(key(f.name)), f):
                st.put_file(key(f.name), ckpt / f.name, crc32c=f.crc32c, size=f.size)
                sent += f.size
            done += f.size
            if self._progress is not None:
                self._progress(done, total)

        missing = [f.name for f in m.files if not _matches(st.head(key(f.name)), f)]
        if any(f.name in missing for f in own):
            raise IntegrityError(f"step {step}: tier 2 does not report what was uploaded "
                                 f"for {sorted(set(missing) & {f.name for f in own})}")
        seconds = time.monotonic() - t0
        if missing:  # other nodes' files: the last node to finish writes the marker
            _write_state(root, step, status="files_verified", bytes=sent, seconds=seconds,
                         **base)
            return UploadResult(step, "files_verified", sent, seconds)

        info = st.put_bytes(key(layout.MANIFEST), manifest_bytes)
        if st.head(key(layout.MANIFEST)) != info:
            raise IntegrityError(f"step {step}: manifest.json on tier 2 does not verify")
        try:
            st.put_bytes(key(layout.COMPLETE), marker, if_none_match=True)
        except ObjectExistsError:
            return self._already_there(step, False, base, t0)
        if st.get_bytes(key(layout.COMPLETE)) != marker:
            raise IntegrityError(f"step {step}: COMPLETE on tier 2 does not read back")
        seconds = time.monotonic() - t0
        _write_state(root, step, status="verified", bytes=sent, seconds=seconds, **base)
        self.log.emit(events.UPLOAD_VERIFIED, step=step, bytes=sent, seconds=seconds,
                      source="uploader")
        self.apply_retention()
        return UploadResult(step, "verified", sent, seconds)

    def _remote_marker(self, key: str) -> bytes | None:
        if self.storage.head(key) is None:
            return None
        return self.storage.get_bytes(key)

    def _already_there(self, step: int, same: bool, base: dict[str, Any],
                       t0: float) -> UploadResult:
        seconds = time.monotonic() - t0
        if same:
            _write_state(self.config.tier1, step, status="verified", bytes=0, seconds=seconds,
                         **base)
            return UploadResult(step, "verified", 0, seconds)
        err = "tier 2 already holds a different checkpoint for this step; left untouched"
        _write_state(self.config.tier1, step, status="conflict", error=err, **base)
        self.log.emit(events.UPLOAD_FAILED, step=step, error=err, source="uploader")
        return UploadResult(step, "conflict", 0, seconds, err)

    def apply_retention(self) -> list[int]:
        """Delete tier-2 checkpoints the tier-2 policy no longer keeps; return their steps."""
        doomed = retention.tier2_deletions(remote_complete_steps(self.storage),
                                           keep_last=self.config.keep_last,
                                           keep_every=self.config.keep_every)
        for step in doomed:
            delete_remote(self.storage, step)
        return doomed


class UploaderProcess:
    """An uploader in a child process (``python -m tierckpt.uploader``) at low priority.

    ``start()`` launches it; ``stop()`` sends SIGTERM (the child finishes the file it is
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
                "--s3-options", json.dumps(dict(c.s3_options)), "--parent", str(os.getpid())]

    def start(self) -> UploaderProcess:
        if self._proc is not None:
            return self
        log_dir = self.config.tier1 / layout.UPLOAD_STATE
        log_dir.mkdir(mode=fs.DEFAULT_DIR_MODE, parents=True, exist_ok=True)
        ready_r, ready_w = os.pipe()  # the child writes one byte once its handlers are set
        try:
            with open(log_dir / "uploader.log", "ab") as log:
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

    def stop(self) -> int | None:
        """Stop the child (SIGTERM, then SIGKILL after ``timeout_s``); its exit code."""
        p = self._proc
        if p is None:
            return None
        if p.poll() is None:
            self._wait_ready(self.timeout_s)
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._ready_r >= 0:
            os.close(self._ready_r)
            self._ready_r = -1
        return p.returncode

    def finish(self, timeout_s: float | None = None) -> int | None:
        """Ask the child to upload everything due and exit (SIGUSR1); wait up to
        ``timeout_s`` (default ``self.timeout_s``), then :meth:`stop` it. Returns its exit
        code: 0 when nothing was left to upload, 1 when an upload failed."""
        p = self._proc
        if p is None:
            return None
        if p.poll() is None:
            self._wait_ready(self.timeout_s)
            p.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(self.timeout_s if timeout_s is None else timeout_s)
        return self.stop()

    close = stop

    def __enter__(self) -> UploaderProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _exit_with_parent(parent: int, stop: threading.Event) -> None:
    """Stop the uploader when ``parent`` (the rank that started it) dies — a SIGKILLed
    rank must not leave an orphan uploading behind the restarted job's back. Linux sends
    SIGTERM on the parent's death (PR_SET_PDEATHSIG); a watcher thread covers the window
    before prctl and other platforms."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent:
                stop.set()
    if os.getppid() != parent:
        stop.set()
    threading.Thread(target=watch, name="tierckpt-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierckpt.uploader TIER1 TIER2 [--watch]``: drain once (default) or
    watch until SIGTERM/SIGINT (exit 0), or until SIGUSR1 and nothing left to upload (exit 0;
    1 if an upload failed). Without --watch: exit 0 when every attempted upload finished."""
    ap = argparse.ArgumentParser(prog="python -m tierckpt.uploader")
    ap.add_argument("tier1", type=Path)
    ap.add_argument("tier2")
    ap.add_argument("--watch", action="store_true")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--keep-every", type=int, default=0)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--s3-options", default="{}")
    ap.add_argument("--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, default=0,
                    help="stop (as on SIGTERM) when this process dies, e.g. a killed rank")
    a = ap.parse_args(argv)
    config = UploaderConfig(tier1=a.tier1, tier2=a.tier2, upload_every=a.every,
                            keep_last=a.keep_last, keep_every=a.keep_every, poll_s=a.poll,
                            s3_options=json.loads(a.s3_options))
    lower_priority()
    stop, finish = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: finish.set())
    if a.parent:
        _exit_with_parent(a.parent, stop)
    if a.ready_fd >= 0:
        os.write(a.ready_fd, b"1")
        os.close(a.ready_fd)
    with Uploader(config) as up:
        if a.watch:
            return 0 if up.watch(stop, finish) or not finish.is_set() else 1
        return 0 if all(r.status in _OK for r in up.drain()) else 1


if __name__ == "__main__":
    sys.exit(main())
