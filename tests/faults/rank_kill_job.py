"""A 2-rank job for rank-kill tests (launched as plain processes with RANK/WORLD_SIZE/
MASTER_* set, not torchrun, so a survivor lives long enough to report its own error).

``--phase kill``: commit step 1 (weights 1), record a CRC snapshot of this rank's tier-1
root, then, on ``--kill-rank``, attach ``strace -p <self>`` injecting SIGKILL at the
``--when``-th ``--syscall`` (counted per thread from here on), and save step 2. The
survivor writes ``{"error": str | None}`` to ``<out>/rank<r>.json``.
``--phase restore``: open the roots again and restore; each rank writes
``{"step", "weight"}``. ``--phase enospc``: with ``on_save_error="continue"``, commit step
1, inject ENOSPC at ``--kill-rank``'s ``--when``-th ``--syscall``, save step 2 (fails), then
step 3 (must commit on every rank).

``--node-local`` gives each rank its own root (``<tier1>/node<r>``), so both ranks are
domain owners and run the commit protocol; otherwise they share one root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch

import tierckpt
from tests.faults._oracle import make_state, set_weights, snapshot, weights_step
from tierckpt import Failures
from tierckpt.errors import SaveError
from tierckpt.format import layout
from tierckpt.runtime.distributed import init_distributed


def _self_strace(syscall: str, when: int, action: str = "signal=KILL",
                 path: Path | None = None) -> subprocess.Popen:
    pid = os.getpid()
    only = ["-P", str(path)] if path is not None else []  # count only calls on this file
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", *only,
                               "-e", f"trace={syscall}",
                               "-e", f"inject={syscall}:{action}:when={when}", "-p", str(pid)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tids = os.listdir(f"/proc/{pid}/task")
        if all(_traced(pid, t) for t in tids):
            return tracer
        time.sleep(0.02)
    raise RuntimeError("strace did not attach")


def _traced(pid: int, tid: str) -> bool:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1]) != 0
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier1", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["kill", "restore", "enospc"], required=True)
    ap.add_argument("--node-local", action="store_true")
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--syscall", default="write")
    ap.add_argument("--when", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = init_distributed(timeout=timedelta(seconds=60))
    rank = info.rank
    root = Path(args.tier1) / f"node{rank}" if args.node_local else Path(args.tier1)
    out = Path(args.out)
    st = make_state(1)
    mode = "continue" if args.phase == "enospc" else "raise"
    with tierckpt.CheckpointManager(tier1=root, keep_last=3, verify="full",
                                    failures=Failures(collective_timeout_s=20,
                                                      on_save_error=mode)) as ck:
        if args.phase == "restore":
            got = ck.restore(st)
            res = {"step": got.step if got else None,
                   "weight": weights_step(st) if got else None}
            (out / f"rank{rank}.json").write_text(json.dumps(res))
            return
        ck.save(1, st).wait()
        if args.phase == "enospc":  # one rank's write fails; training goes on
            if rank == args.kill_rank:  # the shard data write of step 2 fails
                shard = root / layout.tmp_dirname(2, f"{ck.run_id}-2") / f"__{rank}_0.distcp"
                _self_strace(args.syscall, args.when, "error=ENOSPC", path=shard)
            set_weights(st.model, 2)
            ck.save(2, st).durable.exception(timeout=60)  # let it fail everywhere first
            set_weights(st.model, 3)
            ck.save(3, st)  # logs step 2's SaveError (on_save_error="continue")
            ck.wait()
            return
        (out / f"snap{rank}.json").write_text(json.dumps(
            {str(k): v for k, v in snapshot(root).items()}))
        if rank == args.kill_rank:
            _self_strace(args.syscall, args.when)
        set_weights(st.model, 2)
        error = None
        try:
            ck.save(2, st)
            ck.wait()
        except SaveError as e:
            error = str(e)
        (out / f"rank{rank}.json").write_text(json.dumps({"error": error}))
        if error:
            os._exit(3)  # the process group is broken: do not wait on it at exit


if __name__ == "__main__":
    main()
