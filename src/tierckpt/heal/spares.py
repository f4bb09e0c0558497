"""Pre-warmed spare workers for the heal launcher: a replacement that has already imported
torch and tierckpt, so a heal does not wait for an interpreter start (seconds here, minutes
with CUDA at scale).

A spare is ``python -m tierckpt.heal.spares`` with the training command's interpreter. It
imports torch, tierckpt, what both import only on first use (:data:`WARM_MODULES`: the
replacement would otherwise import them inside the heal) and the modules the script imports
at its top level, writes ``ready`` on a pipe of its own (its stdout and stderr are the job's)
and blocks on its stdin; :meth:`SparePool.take` writes it one JSON line — the worker's
environment — and it runs the training script as ``__main__`` in that environment.

Only a command that starts with a Python interpreter can use a spare (``python train.py
...`` or ``python -m pkg ...``); for any other, ``take`` returns None and the launcher
starts the replacement cold.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_ENV_FD = "TIERCKPT_SPARE_FD"


def spare_command(command: Sequence[str]) -> list[str] | None:
    """The spare's command line for a training ``command``, or None when it does not start
    with a Python interpreter."""
    if len(command) < 2 or not Path(command[0]).name.startswith("python"):
        return None
    return [command[0], "-m", "tierckpt.heal.spares", *command[1:]]


class SparePool:
    """Keeps ``size`` spares started (each replaced as soon as one is taken)."""

    def __init__(self, command: Sequence[str], size: int) -> None:
        self._cmd = spare_command(command) if size > 0 else None
        self._size = size
        self._idle: list[tuple[subprocess.Popen[bytes], int]] = []  # (spare, its ready pipe)
        self.fill()

    def fill(self) -> None:
        """Start spares until ``size`` are idle (a spare taken is not replaced until this is
        called: the launcher does it once the heal that took it has stepped)."""
        if self._cmd is None:
            return
        while len(self._idle) < self._size:
            r, w = os.pipe()
            try:
                p = subprocess.Popen(self._cmd, stdin=subprocess.PIPE, pass_fds=(w,),
                                     env={**os.environ, _ENV_FD: str(w)})
            except BaseException:
                os.close(r)
                raise
            finally:
                os.close(w)
            self._idle.append((p, r))

    @property
    def waiting(self) -> int:
        """Spares started and not taken (ready or still importing)."""
        return len(self._idle)

    def take(self, env: dict[str, str], wait_s: float = 0.0) -> subprocess.Popen[bytes] | None:
        """A spare that has finished importing, told to run as the worker ``env`` describes;
        None when none is ready (the launcher then starts a process cold) — after waiting up
        to ``wait_s`` for one still importing (it is further along than a cold start)."""
        if wait_s > 0 and self._idle:
            select.select([r for _, r in self._idle], [], [], wait_s)
        for p, r in list(self._idle):
            ready, _, _ = select.select([r], [], [], 0)
            if p.poll() is not None or (ready and os.read(r, 16) != b"ready\n"):
                self._drop(p, r)  # died, or closed its pipe without a word
                continue
            if not ready:
                continue
            self._idle.remove((p, r))
            os.close(r)
            assert p.stdin is not None
            p.stdin.write((json.dumps(env) + "\n").encode())
            p.stdin.close()
            return p
        return None

    def _drop(self, p: subprocess.Popen[bytes], r: int) -> None:
        self._idle.remove((p, r))
        os.close(r)
        if p.poll() is None:
            p.kill()
        p.wait()

    def close(self) -> None:
        for p, r in list(self._idle):
            self._drop(p, r)


def main(argv: list[str]) -> int:
    """The spare: import, say ``ready``, then run ``argv`` (a script and its arguments, or
    ``-m module ...``) as ``__main__`` in the environment read from stdin."""
    import runpy

    _warm()
    script = argv[0] if argv and argv[0] != "-m" else None
    if script is not None:
        sys.path.insert(0, str(Path(script).resolve().parent))
        _preimport(Path(script))
    fd = int(os.environ.pop(_ENV_FD))
    os.write(fd, b"ready\n")
    os.close(fd)
    line = sys.stdin.readline()
    if not line:
        return 0  # the launcher closed the pool
    os.environ.update(json.loads(line))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    if argv and argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
    return 0


#: Modules a training process imports only when it first needs them, and which a
#: replacement would otherwise import inside the heal: ``torch._dynamo`` (~0.9 s here; FSDP2's
#: first ``fully_shard`` imports it through ``torch._compile``), DCP, and tierckpt's own lazy
#: modules (the manager and the restore path).
WARM_MODULES = ("torch", "torch._dynamo", "torch.distributed.checkpoint",
                "torch.distributed.fsdp", "tierckpt.config", "tierckpt.data",
                "tierckpt.manager", "tierckpt.policy.interval", "tierckpt.preempt.config",
                "tierckpt.restore.loader", "tierckpt.restore.verify",
                "tierckpt.runtime.distributed", "tierckpt.runtime.watchdog",
                "tierckpt.save.config", "tierckpt.save.saver", "tierckpt.share.loader",
                "tierckpt.share.ranged", "tierckpt.state", "tierckpt.tier0.config",
                "tierckpt.tier2.config")
#: (tests/heal/test_spares.py checks that every module behind a lazy name is listed)


def _warm() -> None:
    """Import :data:`WARM_MODULES`."""
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)


def _preimport(script: Path) -> None:
    """Import the modules ``script`` imports at its top level (its other statements do not
    run), so the replacement finds them loaded too; one that fails to import is left to the
    script to report."""
    import ast
    import importlib

    try:
        tree = ast.parse(script.read_text(), str(script))
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # the script's own import reports it
                continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
