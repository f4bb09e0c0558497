"""One node-loss heal vs one full restart of the same multi-node job (issue 43), simulated
nodes on this machine (tests/heal/test_nodes.py's Cluster), a private etcd.

    PYTHONPATH=src:. python tests/scripts/measure_node_heal.py OUT_DIR [REPEATS] [2x1|3x2] \
        [TRAIN_ARGS]

2x1: 2 nodes x 1 rank, DDP (+ 1 spare node for the heal); 3x2: 3 nodes x 2 ranks, FSDP2 (+
1 spare node). TRAIN_ARGS: more examples/train.py arguments in one string, e.g. "--dim 672
--layers 4" for ~250 MiB of state (12 bytes per parameter: weights and two Adam moments;
~12·dim² parameters per layer). examples/train.py with 0.5 s steps; the node holding slot
1 is killed (killpg) at step >= 12, once the spare node had 20 s to pre-warm its workers.
The full restart is the same job without a spare node, a node started again as soon as the
slot is freed (as a scheduler with a node at hand would). Prints JSON: R = the kill -> the
first loss row written after it, and the times of the parts after the kill (events of
every rank; heal_done's leave/wait/form/open/restore per survivor)."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.etcdserver import EtcdCluster, start_cluster
from tests.heal.test_heal_jobs import _events
from tests.heal.test_nodes import Cluster, _start_in_order


def _after(ev: list[dict[str, Any]], kind: str, t0: float) -> list[float]:
    return [round(e["t"] - t0, 3) for e in ev if e["event"] == kind and e["t"] > t0]


def run(heal: bool, base: Path, etcd: EtcdCluster, extra: tuple[str, ...], nnodes: str,
        nproc: int, names: list[str], kill: str) -> dict[str, Any]:
    c = Cluster(base, etcd, nnodes, nproc, *extra)
    try:
        _start_in_order(c, names, len(names) - (1 if heal else 0))
        t_up = time.monotonic()
        c.wait_for("step 12", lambda: len(c.losses()) >= 13 and time.monotonic() - t_up > 20)
        t_kill = time.time()
        c.nodes[kill].kill()
        out: dict[str, Any] = {}
        if not heal:
            c.wait_for("slot 1 freed", lambda: c.holder(1) == "")
            out["slot_freed"] = round(time.time() - t_kill, 3)
            c.start(kill + "-again")
        for n in c.nodes.values():
            if n.name != kill:
                n.finish()
        rows = c.losses()
        first = next(r for r in rows if r["t"] > t_kill)
        steps = sorted(b["t"] - a["t"] for a, b in itertools.pairwise(rows[3:12]))
        ev = _events(c.tmp / "t1")
        out.update(R=round(first["t"] - t_kill, 3), step_after=first["step"],
                   steady_step=round(steps[len(steps) // 2], 3),
                   process_start=_after(ev, "process_start", t_kill),
                   pg_ready=_after(ev, "pg_ready", t_kill),
                   restore_done=_after(ev, "restore_done", t_kill))
        if heal:
            done = [e for e in ev if e["event"] == "heal_done"]
            out["heal_begin"] = _after(ev, "heal_begin", t_kill)
            out["heal_done"] = _after(ev, "heal_done", t_kill)
            out.update({k: [round(e[k], 3) for e in done]
                        for k in ("leave_s", "wait_s", "form_s", "open_s", "restore_s")})
        return out
    finally:
        c.close()


def main() -> None:
    base = Path(sys.argv[1])
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    shape = sys.argv[3] if len(sys.argv) > 3 else "2x1"
    more = tuple(sys.argv[4].split()) if len(sys.argv) > 4 else ()
    base.mkdir(parents=True, exist_ok=True)
    etcd = start_cluster(base / "etcd")
    res: dict[str, Any] = {}
    try:
        for i in range(repeats):
            if shape == "2x1":
                extra: tuple[str, ...] = ("--parallel", "ddp", "--step-sleep", "0.5", *more)
                res[f"heal{i}"] = run(True, base / f"heal{i}", etcd, extra, "2:3", 1,
                                      ["n0", "n1", "spare"], "n1")
                res[f"restart{i}"] = run(False, base / f"restart{i}", etcd, extra, "2", 1,
                                         ["n0", "n1"], "n1")
            else:
                extra = ("--step-sleep", "0.5", *more)
                res[f"heal{i}"] = run(True, base / f"heal{i}", etcd, extra, "3:4", 2,
                                      ["n0", "n1", "n2", "spare"], "n1")
                res[f"restart{i}"] = run(False, base / f"restart{i}", etcd, extra, "3", 2,
                                         ["n0", "n1", "n2"], "n1")
    finally:
        etcd.stop()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
