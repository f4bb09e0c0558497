"""A fork server for the syscall sweep: imports torch and tierckpt once, then forks one
child per trial so each trial costs a fork, not an interpreter start.

Protocol (one JSON object per line): the test writes ``{"root", "fifo", "step",
"keep_last"}`` to stdin; the zygote forks and prints ``{"pid"}``; the child builds the
small model, opens a ``CheckpointManager`` on ``root`` (start-up cleanup and the lock happen
here, before the test attaches strace), then blocks reading ``fifo``. When the test writes
to the fifo the child saves ``step`` (weights = step), waits for the commit and closes.
The zygote prints ``{"pid", "status"}`` (``os.waitpid`` status) when the child is gone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import torch

torch.set_num_threads(1)

import tierckpt  # noqa: E402
from tests.faults._oracle import make_state  # noqa: E402


def _child(cmd: dict) -> int:
    st = make_state(cmd["step"])
    ck = tierckpt.CheckpointManager(tier1=cmd["root"], keep_last=cmd["keep_last"])
    with open(cmd["fifo"], "rb") as f:  # blocks until the test has attached strace
        f.read()
    try:
        ck.save(cmd["step"], st).wait()
    finally:
        ck.close()
    return 0


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
                code = _child(cmd)
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
