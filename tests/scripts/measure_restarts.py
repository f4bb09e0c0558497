"""Reproduce the restart measurements in docs/restarts.md (a tool, not a test).

    python tests/scripts/measure_restarts.py --mode plain --runs 20
    python tests/scripts/measure_restarts.py --mode restart-prefix --runs 6 --agents 2

Each run is a separate torchrun job (``--standalone`` with 2 workers, or ``--agents 2``
agents with one worker each on a c10d rendezvous) in which one rank SIGKILLs itself once
(``restart_loop.py --kill-until 1``); the run is ``clean`` when the job exits 0, ``failed``
when it exits non-zero, ``hang`` when it is still running after ``--limit`` seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tierckpt._ports import free_port

LOOP = Path(__file__).with_name("restart_loop.py")


def _one(mode: str, agents: int, limit: float, out: Path, timeout: float) -> tuple[str, str]:
    script = [str(LOOP), "--out", str(out), "--kill-until", "1", "--mode", mode,
              "--timeout", str(timeout)]
    run = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1",
           "--monitor-interval", "0.1"]
    if agents == 1:
        cmds = [[*run, "--standalone", "--nproc-per-node", "2", *script]]
    else:
        rdzv = ["--nnodes", str(agents), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", out.name]
        cmds = [[*run, *rdzv, *script]] * agents
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for c in cmds]
    outcome = "clean"
    for p in procs:
        try:
            if p.wait(timeout=limit) != 0 and outcome == "clean":
                outcome = "failed"
        except subprocess.TimeoutExpired:
            outcome = "hang"
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    starts = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    # Both jobs have 2 ranks; the records after the first two starts are the restart's.
    counts = [(r["rank"], r["attempt"]) for r in starts if r["stage"] == "start"][2:]
    return outcome, str(sorted(counts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="tierckpt", choices=["tierckpt", "plain", "restart-prefix"])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--agents", type=int, default=1)
    ap.add_argument("--limit", type=float, default=60.0, help="seconds before a run is a hang")
    ap.add_argument("--timeout", type=float, default=20.0, help="process-group timeout")
    args = ap.parse_args()
    tally: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}"
            out.mkdir()
            outcome, counts = _one(args.mode, args.agents, args.limit, out, args.timeout)
            tally[outcome] += 1
            print(f"{args.mode} run {i + 1}: {outcome}  restart (rank, count): {counts}",
                  flush=True)
    print(dict(tally))
    return 0


if __name__ == "__main__":
    sys.exit(main())
