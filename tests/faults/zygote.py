"""A fork server for the syscall sweep: imports torch and tierckpt once, then forks one
child per trial so each trial costs a fork, not an interpreter start.

Protocol (one JSON object per line): the test writes a command (see :func:`_child`) to
stdin; the zygote forks and prints ``{"pid"}``; the child builds the small model, opens a
``CheckpointManager`` on ``root`` and saves. The child blocks reading ``fifo`` until the
test has attached strace: before it opens the manager (so start-up is traced too), or with
``after_open`` after it (it touches ``<fifo>.ready`` once the manager is open).
The zygote prints ``{"pid", "status"}`` (``os.waitpid`` status) when the child is gone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)

import tierckpt  # noqa: E402
from tests.faults._oracle import make_state, set_weights  # noqa: E402
from tierckpt import Failures, Tier2  # noqa: E402
from tierckpt.errors import SaveError  # noqa: E402


def _restore(cmd: dict) -> int:
    """``action="restore"``: wait for the fifo, then restore ``root`` (fetching from
    ``tier2`` what tier 1 lacks); write ``{"step"}`` to ``result``."""
    with open(cmd["fifo"], "rb") as f:
        f.read()
    tier2 = cmd["tier2"] and Tier2(cmd["tier2"], start_uploader=False)
    with tierckpt.CheckpointManager(tier1=cmd["root"], keep_last=cmd["keep_last"],
                                    tier2=tier2, verify="full") as ck:
        info = ck.restore(make_state(-1))
    _write_result(cmd["result"], {"step": info.step if info else None})
    return 0


def _child(cmd: dict) -> int:
    """Wait for the fifo, open a manager on ``root`` and save each of ``steps`` (with
    ``after_open``: open the manager, touch ``<fifo>.ready``, then wait for the fifo).
    ``wait_each`` waits for every commit (an error ends the child with code 3); otherwise
    only the last save is waited for, so with ``on_save_error=continue`` a failed save is
    logged by the next ``save()`` and training goes on. Errors go to ``result`` (JSON)."""
    steps = cmd.get("steps", [cmd.get("step")])
    st = make_state(steps[0])

    def go() -> None:
        with open(cmd["fifo"], "rb") as f:  # blocks until the test has attached strace
            f.read()

    if not cmd.get("after_open"):
        go()  # traced from here: start-up (lock, cleanup) is part of the sweep
    ck = tierckpt.CheckpointManager(tier1=cmd["root"], keep_last=cmd["keep_last"],
                                    failures=Failures(
                                        on_save_error=cmd.get("on_save_error", "raise")))
    Path(cmd["fifo"] + ".ready").touch()
    if cmd.get("after_open"):
        go()
    errors: list[str] = []
    try:
        for i, step in enumerate(steps):
            set_weights(st.model, step)
            handle = ck.save(step, st)
            if cmd.get("wait_each", True) or i == len(steps) - 1:
                ck.wait()
            else:  # let it end (done() never raises) before the next save() reports it:
                while not handle.done():  # the next save's event writes would otherwise
                    time.sleep(0.005)     # race this one's, and strace's write count with it
    except SaveError as e:
        errors.append(str(e))
    finally:
        try:
            ck.close()
        except SaveError as e:
            errors.append(str(e))
        if cmd.get("result"):
            _write_result(cmd["result"], {"errors": errors})
    return 3 if errors else 0


def _write_result(path: str, value: dict) -> None:
    """The harness's own result, written with ``pwrite``, not ``write``: strace's
    ``inject=write:when=N`` counts per thread, so the main thread's N-th ``write`` could
    otherwise be this file's and fail the child instead of the save under test."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, json.dumps(value).encode(), 0)
    finally:
        os.close(fd)


def _warm_up() -> None:
    """One save and restore before serving, so the children inherit every lazy import
    (DCP imports parts of torch on first use) and their syscalls are the save's own."""
    with tempfile.TemporaryDirectory() as d:
        st = make_state(1)
        with tierckpt.CheckpointManager(tier1=d) as ck:
            ck.save(1, st).wait()
        with tierckpt.CheckpointManager(tier1=d) as ck:
            ck.restore(st)


def main() -> None:
    _warm_up()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _restore(cmd) if cmd.get("action") == "restore" else _child(cmd)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": status}), flush=True)


if __name__ == "__main__":
    main()
