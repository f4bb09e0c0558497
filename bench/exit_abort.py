"""How often a finished FSDP2-over-gloo job aborts at interpreter exit, with and without
tierckpt.init_distributed (which collects garbage at exit, before finalisation).

``python -m bench.exit_abort --runs 50``: alternates the two modes of the same 2-rank
``fully_shard`` + AdamW script under torchrun (no checkpointer); a run aborts when a rank
exits non-zero or prints "terminate called". Prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
if sys.argv[1] == "tierckpt":
    import tierckpt
    tierckpt.init_distributed()
else:
    dist.init_process_group("gloo")
def main():
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters())
    for _ in range(3):
        m(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
main()
"""


def _once(script: Path, mode: str) -> str | None:
    """None when the run exited cleanly; else ``"abort"`` (SIGABRT at exit, "terminate
    called") or ``"other: <last line>"`` (any other failure, e.g. the launch)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=0", str(script), mode],
        capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if "terminate called" in out or "Signals.SIGABRT" in out:
        return "abort"
    if proc.returncode != 0:
        return "other: " + (out.strip().splitlines() or [""])[-1][-200:]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.exit_abort", description=__doc__)
    p.add_argument("--runs", type=int, default=50, help="runs per mode")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = p.parse_args(argv)
    aborts = {"plain": 0, "tierckpt": 0}
    other: dict[str, list[str]] = {"plain": [], "tierckpt": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "fsdp_exit.py"
        script.write_text(SCRIPT)
        for _ in range(args.runs):
            for mode in aborts:  # alternate: the host's state moves the rate
                outcome = _once(script, mode)
                aborts[mode] += outcome == "abort"
                if outcome is not None and outcome != "abort":
                    other[mode].append(outcome)
    doc = {"runs_per_mode": args.runs, "aborts": aborts, "other_failures": other,
           "seconds": time.time() - t0,
           "script": "2-rank fully_shard + AdamW under torchrun, gloo, no checkpointer"}
    print("| init | runs | aborted at exit | other failures |\n|---|---|---|---|")
    for mode, n in aborts.items():
        label = "dist.init_process_group" if mode == "plain" else "tierckpt.init_distributed"
        print(f"| {label} | {args.runs} | {n} ({100 * n / args.runs:.0f} %) | "
              f"{len(other[mode])} |")
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
