"""A training loop that stops stepping, watched by tierckpt.StepWatchdog.

Modes:
  single   one process; 3 steps, then blocks forever in ``_stuck_in_data_loader``.
  steady   one process; 30 quick steps, then closes the watchdog and exits 0.
  torchrun under torchrun (gloo): every step is an all_reduce; on attempt 0 the last rank
           stops stepping after step 2 (``_rank_stops_stepping``) so the others block inside
           all_reduce; every rank's watchdog fires and torchrun restarts the group. Attempt 1
           runs 5 steps and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from datetime import timedelta


def _stuck_in_data_loader() -> None:
    threading.Event().wait()


def _rank_stops_stepping() -> None:
    threading.Event().wait()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, choices=["single", "steady", "torchrun"])
    p.add_argument("--events", required=True)
    p.add_argument("--hang-timeout", type=float, default=1.0)
    args = p.parse_args()

    from tierckpt.runtime.watchdog import StepWatchdog

    if args.mode in ("single", "steady"):
        with StepWatchdog(args.hang_timeout, event_log=args.events) as wd:
            for step in range(30 if args.mode == "steady" else 3):
                time.sleep(0.005)
                wd.step_completed(step)
            if args.mode == "single":
                _stuck_in_data_loader()
        return 0

    import torch
    import torch.distributed as dist

    from tierckpt.runtime.distributed import init_distributed

    info = init_distributed("gloo", timeout=timedelta(seconds=120), event_log=args.events)
    hang = info.restart_count == 0
    with StepWatchdog(args.hang_timeout, event_log=args.events) as wd:
        for step in range(5):
            if hang and step == 3 and info.rank == info.world_size - 1:
                _rank_stops_stepping()
            x = torch.ones(1)
            dist.all_reduce(x)
            wd.step_completed(step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
