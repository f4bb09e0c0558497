"""Drive the fork server (``zygote.py``) and strace: one save per trial, optionally with a
fault injected at the N-th call of one syscall, counted from just before ``save()``."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

STRACE = shutil.which("strace") or "/usr/bin/strace"
# what a save does to the file system (openat/write/fsync for files, rename/link for the
# commit, unlink/rmdir for retention and the marker's tmp name)
SYSCALLS = ("openat", "write", "fsync", "fdatasync", "mkdir", "rename", "renameat",
            "renameat2", "link", "linkat", "unlink", "unlinkat", "rmdir")


def strace_usable() -> bool:
    """strace is installed and may attach to a process that is not its child (root, or
    Yama's ptrace_scope is 0)."""
    if not os.path.exists(STRACE):
        return False
    if os.geteuid() == 0:
        return True
    try:
        return Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() == "0"
    except OSError:
        return True


_LINE = re.compile(r"^(\d+)\s+([a-z0-9_]+)\(")
REPO = Path(__file__).resolve().parents[2]


class Zygote:
    """The fork server process; a context manager."""

    def __init__(self, log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(REPO)}
        self._err = open(log, "ab")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.faults.zygote"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env)
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        self._readline(300.0)  # {"ready": true} after the warm-up save

    def _readline(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise TimeoutError(f"fork server silent for {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"fork server exited ({self.proc.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def trial(self, root: Path, step: int, keep_last: int, strace_args: list[str],
              timeout: float = 120.0, *, after_open: bool = False, **extra: object) -> int:
        """Run one save of ``step`` into ``root`` with strace attached (``strace_args``
        are the filter/inject options): from the start of the child, or with
        ``after_open`` once its manager is open. ``extra`` goes into the child's command
        (``steps``, ``on_save_error``, ``wait_each``, ``result``). Returns the child's
        ``waitpid`` status."""
        fifo = root.parent / f"{root.name}.go"
        os.mkfifo(fifo)
        ready = Path(f"{fifo}.ready")
        assert self.proc.stdin is not None
        cmd = {"root": str(root), "fifo": str(fifo), "step": step, "keep_last": keep_last,
               "after_open": after_open, **extra}
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._readline(timeout)["pid"]
        if after_open:
            deadline = time.monotonic() + timeout
            while not ready.exists():
                if b"\n" in self._buf or self._sel.select(0.02):
                    break  # the child ended before its manager was open
                if time.monotonic() > deadline:
                    raise TimeoutError("child never opened its manager")
        tracer = subprocess.Popen([STRACE, "-f", "-qq", *strace_args, "-p", str(pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_traced(pid, tracer, timeout)
            self._go(fifo, timeout)
            status = self._readline(timeout)["status"]
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                tracer.wait(timeout)
            if tracer.poll() is None:
                tracer.kill()
                tracer.wait()
            fifo.unlink()
            ready.unlink(missing_ok=True)
        return int(status)

    def _go(self, fifo: Path, timeout: float) -> None:
        """Release the child; if it died before opening the fifo (a kill during start-up),
        there is no reader and the zygote has already reported its status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
            else:
                os.write(fd, b"go")
                os.close(fd)
                return
            if b"\n" in self._buf or self._sel.select(0.02):
                return
        raise TimeoutError(f"child never opened {fifo}")

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def _wait_traced(pid: int, tracer: subprocess.Popen, timeout: float) -> None:
    """Block until strace has seized every thread of ``pid`` (TracerPid set), or the child
    is already gone (an injected kill can land before this loop looks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tracer.poll() is not None:
            return
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return
        if all(_tracer_of(pid, t) for t in tasks):
            return
        time.sleep(0.02)
    raise TimeoutError(f"strace did not attach to {pid} in {timeout} s")


def _tracer_of(pid: int, tid: str) -> int:
    with contextlib.suppress(FileNotFoundError):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def per_thread_calls(trace_log: Path) -> dict[str, list[str]]:
    """From an ``strace -f -y -o`` log: for each syscall, the first argument (a path, or
    an fd shown with its path) of each call by the thread that made the most such calls
    (strace's ``when=N`` counts per thread, so the busiest thread sets the range of N)."""
    calls: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for line in trace_log.read_text().splitlines():
        m = _LINE.match(line)
        if m:
            calls[(m.group(1), m.group(2))].append(_target(line[m.end():]))
    out: dict[str, list[str]] = {}
    for (_, name), targets in calls.items():
        if len(targets) > len(out.get(name, [])):
            out[name] = targets
    return out


def _target(args: str) -> str:
    m = re.search(r'<([^>]*)>|"([^"]*)"', args)
    return (m.group(1) or m.group(2)) if m else "?"


def kill_points(calls: dict[str, list[str]], cap: int) -> Iterator[tuple[str, int, str]]:
    """``(syscall, N, target)`` to inject at: every N when a syscall was made at most
    ``cap`` times; otherwise the first and the last call on each distinct target (so every
    file of the save gets a kill at its start and end) plus ``cap`` evenly spaced N."""
    for name in sorted(calls):
        targets = calls[name]
        c = len(targets)
        if c <= cap:
            ns = set(range(1, c + 1))
        else:
            ns = {1 + round(i * (c - 1) / (cap - 1)) for i in range(cap)}
            first: dict[str, int] = {}
            last: dict[str, int] = {}
            for i, t in enumerate(targets, 1):
                first.setdefault(t, i)
                last[t] = i
            ns |= set(first.values()) | set(last.values())
        for n in sorted(ns):
            yield name, n, targets[n - 1]


_OP = re.compile(r"^(\d+)\s+([a-z0-9_]+)\((.*)$")


def fs_ops(trace_log: Path) -> list[tuple[str, tuple[str, ...]]]:
    """The file-system operations of an ``strace -f -y`` log in order, each as
    ``(syscall, paths)``: the fd's path for write/fsync, both paths for rename/link, the
    opened path for openat (interrupted calls count at their start)."""
    ops = []
    for line in trace_log.read_text().splitlines():
        m = _OP.match(line)
        if not m:
            continue
        name, rest = m.group(2), m.group(3)
        if name in ("write", "fsync", "fdatasync", "close"):
            fd = re.match(r"\d+<([^>]*)>", rest)
            ops.append((name, (fd.group(1),) if fd else ()))
        else:
            ops.append((name, tuple(re.findall(r'"([^"]*)"', rest))))
    return ops
