"""The node-loss heal drill (``tierckpt drill --heal --nnodes N``): one job of N simulated
nodes on this machine, a seeded series of node losses, and the proof that each ended in a
heal by a spare node (or, when no spare node is left, a full restart) that lost nothing and
changed no loss.

1. **reference** — the command uninterrupted under torchrun with N·P ranks: the losses.
2. **nodes** — N + S nodes, each a ``tierckpt run --nnodes N:N+S`` supervisor in a session
   of its own with its own tier-1 root (S = the spare nodes the faults use up), one tier 2
   (a ``file://`` directory of the drill unless ``--tier2``), the job's store in etcd
   (``--etcd``, else a private one the drill starts: :mod:`tierckpt.drill.etcd`). One fault
   after another, each once a seeded step is logged and the previous one is over:

   Each fault waits until tier 2 holds a complete checkpoint newer than the previous
   fault's step: the lost node's ranks restore from tier 2 (their disk is gone).

   ==========  =================================================================  ========
   fault       what is lost                                                       expected
   ==========  =================================================================  ========
   node_lost   a seeded running node: supervisor and workers SIGKILLed at once,   heal
               its tier-1 root and tier-0 RAM deleted (gone with the node)
   two_nodes   two running nodes so, at once                                      heal
   store_node  a running node so, and the member of the job's 3-member etcd it       heal
               hosted (node n<i> hosts member m<i>; the drill's own etcd only)
   spare_lost  a running node so, then the spare node that takes its slot, as its    restart
               ranks load; the drill starts a fresh node once the slot is free
   no_spare    a running node so, when no spare node waits; the drill starts a    restart
               fresh node once its slot is free (as a scheduler would)
   ==========  =================================================================  ========

Verdicts as the heal drill's (:mod:`tierckpt.drill.heal`): ``continuity``, ``outcomes``
(``heal``: survivors healed and not every rank started again; ``restart``: every rank
started again), ``finished`` (every node left exited 0). R per fault: the kill → the first
step logged after it. :func:`run_heal_nodes` returns the report and never raises for a
failed verdict.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from tierckpt.drill.etcd import PrivateEtcd, private_etcd
from tierckpt.drill.heal import judge
from tierckpt.drill.launch import JobSpec, training_argv
from tierckpt.drill.reportfile import write_report_files
from tierckpt.drill.runs import RunResult, run_job
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.runtime import events as ev
from tierckpt.runtime.nodespec import parse_endpoint
from tierckpt.tier0.root import default_root
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

__all__ = ["NODE_FAULTS", "NODE_STAGES", "NodeDrillConfig", "run_heal_nodes"]

NODE_STAGES = ("reference", "nodes")
NODE_FAULTS = {"node_lost": "heal", "two_nodes": "heal", "store_node": "heal",
               "spare_lost": "restart", "no_spare": "restart"}
"""Each fault and how it must end."""
_LOST = {"node_lost": 1, "two_nodes": 2, "store_node": 1, "spare_lost": 1, "no_spare": 1}
ETCD_MEMBERS = 3
"""Members of the drill's own etcd when ``store_node`` loses one (else one)."""
_POLL_S = 0.05
_DETECT_S = 3.0  # --node-timeout's default: an etcd election (1-2 s) plus a client's retries

Progress = Callable[[str, str, str], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeDrillConfig:
    """What to drill: ``command`` (the contract of :mod:`tierckpt.drill.launch`; its loop
    heals as examples/train.py's does) on ``nnodes`` nodes of ``nproc`` ranks, ``steps``
    steps, the ``faults`` in order (names of :data:`NODE_FAULTS`; a ``no_spare`` after every
    heal, which use the spare nodes up), ``seed`` for the steps and nodes, the job's
    ``etcd`` (None: a private one), ``tier2`` (None: a directory under ``out``),
    ``job_timeout_s`` per run."""

    command: tuple[str, ...]
    out: Path = Path("drill-out")
    nnodes: int = 2
    nproc: int = 1
    steps: int = 80
    faults: tuple[str, ...] = tuple(NODE_FAULTS)
    seed: int = 0
    etcd: str | None = None
    tier2: str | None = None
    job_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("give the training command after --, e.g. "
                              "tierckpt drill --heal --nnodes 2 -- python examples/train.py")
        unknown = [f for f in self.faults if f not in NODE_FAULTS]
        if unknown or not self.faults:
            raise ConfigError(f"node faults {unknown or '(none)'}: choose from "
                              f"{', '.join(NODE_FAULTS)}")
        if self.nnodes < 2 or self.nproc < 1:
            raise ConfigError(f"the node drill needs --nnodes >= 2 and --nproc >= 1, got "
                              f"{self.nnodes} and {self.nproc}")
        if "two_nodes" in self.faults and self.nnodes < 3:
            raise ConfigError("two_nodes needs --nnodes >= 3 (a node must survive)")
        heals = [i for i, f in enumerate(self.faults) if NODE_FAULTS[f] == "heal"]
        for late, before in (("spare_lost", heals), ("no_spare", heals + [
                i for i, f in enumerate(self.faults) if f == "spare_lost"])):
            if any(f == late and i < max(before, default=-1)
                   for i, f in enumerate(self.faults)):
                raise ConfigError(f"{late} must come after every heal fault"
                                  f"{' and spare_lost' if late == 'no_spare' else ''} (they "
                                  "use the spare nodes up; a spare left would heal it)")
        if self.etcd is not None:
            parse_endpoint(self.etcd, flag="--etcd")
            if "store_node" in self.faults:
                raise ConfigError("store_node kills the etcd member its node hosts: only the "
                                  "drill's own etcd can lose one (leave out --etcd)")
        if self.steps < 15 * (len(self.faults) + 1):
            raise ConfigError(f"--steps {self.steps} is too few for {len(self.faults)} "
                              f"faults: give at least {15 * (len(self.faults) + 1)}")

    @property
    def spares(self) -> int:
        """Spare nodes to start: one per node the heal faults lose, one per spare_lost."""
        return sum(_LOST[f] for f in self.faults
                   if NODE_FAULTS[f] == "heal" or f == "spare_lost")


def run_heal_nodes(cfg: NodeDrillConfig, progress: Progress = lambda *a: None
                   ) -> dict[str, Any]:
    """Run the drill; the report document (also ``<out>/heal-nodes-report.json``, ``.md``)."""
    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress("reference", "running", "")
    ref = run_job(JobSpec(name="nodes-reference", command=cfg.command,
                          roots=(out / "nodes-reference" / "t1",),
                          losses=out / "nodes-reference" / "losses.jsonl", steps=cfg.steps,
                          nproc=cfg.nnodes * cfg.nproc), timeout_s=cfg.job_timeout_s)
    progress("reference", "done" if ref.rc == 0 else "failed", f"exit {ref.rc}")
    progress("nodes", "running", "")
    run = _NodesRun(cfg, out / "nodes-run")
    if ref.rc == 0:
        if cfg.etcd is not None:
            faults = run.drive(cfg.etcd)
        else:
            members = ETCD_MEMBERS if "store_node" in cfg.faults else 1
            with private_etcd(out / "nodes-run" / "etcd", members) as etcd:
                run.private = etcd
                faults = run.drive(etcd.endpoint)
    else:
        faults = []
    progress("nodes", "done" if run.rc == 0 else "failed", f"exit {run.rc}")
    doc = _report(cfg, ref, run, faults)
    files = write_report_files(doc, out, "heal-nodes-report", _markdown, record=False)
    doc["files"] = {"report": files["md"]}
    progress("report", "done", files["md"])
    return doc


@dataclasses.dataclass
class _Node:
    name: str
    root: Path
    proc: subprocess.Popen[bytes]
    lost: bool = False


class _NodesRun:
    """The nodes of the job and their faults."""

    def __init__(self, cfg: NodeDrillConfig, d: Path) -> None:
        self.cfg, self.dir, self.losses = cfg, d, d / "losses.jsonl"
        d.mkdir(parents=True, exist_ok=True)
        if cfg.tier2 is None:
            (d / "tier2").mkdir(parents=True, exist_ok=True)  # created empty, as every drill
        self.tier2 = cfg.tier2 or (d / "tier2").as_uri()
        self.job = f"drill-{uuid.uuid4().hex[:12]}"
        self.rc: int | None = None
        self.nodes: list[_Node] = []
        self.rng = random.Random(cfg.seed)
        self._store: Any = None
        self._tier2: Any = None
        self.private: PrivateEtcd | None = None  # the drill's own etcd, if it started one
        self._shipped: list[dict[str, Any]] = []  # the lost nodes' events (see _lose)

    def drive(self, etcd: str) -> list[dict[str, Any]]:
        from tierckpt.runtime.etcdstore import EtcdStore  # torch: the drill runs it anyway

        cfg, records = self.cfg, list[dict[str, Any]]()
        self.etcd = etcd
        self._store = EtcdStore(parse_endpoint(etcd), self.job, timeout=timedelta(seconds=30))
        self._tier2 = open_storage(self.tier2)
        try:
            for i in range(cfg.nnodes):  # slots 0.. in order, then the spare nodes
                self._start(f"n{i}")
                self._wait(f"n{i} to hold slot {i}", functools.partial(self._holds, i))
            for i in range(cfg.spares):
                self._start(f"spare{i}")
            # faults at span, 2 span, ...: the last leaves two spans to heal or restart in
            # (its tier-2 wait lets the job run on meanwhile)
            span = cfg.steps // (len(cfg.faults) + 2)
            prev = -1
            for i, kind in enumerate(cfg.faults):
                at = span * (i + 1) + self.rng.randrange(0, max(1, span // 3))
                records.append(self._fault(kind, at, after=prev))
                prev = at
            self.rc = self._finish()
        except TimeoutError as e:
            records.append({"kind": "error", "error": str(e)})
            self.rc = None
        finally:
            for n in self.nodes:
                if n.proc.poll() is None:
                    os.killpg(n.proc.pid, signal.SIGKILL)
                    n.proc.wait()
            self._store.close()
            self._tier2.close()
        return records

    # -- the nodes --------------------------------------------------------------------------
    def _start(self, name: str) -> _Node:
        cfg = self.cfg
        root = self.dir / name / "t1"
        root.mkdir(parents=True, exist_ok=True)
        train = training_argv(cfg.command, tier1=root, losses=self.losses, steps=cfg.steps,
                              tier2=self.tier2)
        argv = [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
                "sys.argv[0] = 'tierckpt'; main()", "run",
                "--nnodes", f"{cfg.nnodes}:{cfg.nnodes + cfg.spares}",
                "--nproc-per-node", str(cfg.nproc), "--rdzv-endpoint", self.etcd,
                "--rdzv-id", self.job, "--node-id", name, "--node-timeout", str(_DETECT_S),
                "--max-restarts", str(len(cfg.faults)), "--", *train]
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        node = _Node(name, root, proc)
        self.nodes.append(node)
        return node

    def _holds(self, slot: int) -> bool:
        """Whether node ``n<slot>`` holds slot ``slot``."""
        return self._holder(slot) == f"n{slot}"

    def _holder(self, slot: int) -> str:
        key = f"nodes/slot/{slot}"
        return self._store.get(key).decode() if self._store.check([key]) else ""

    def _running(self) -> list[_Node]:
        held = {self._holder(s) for s in range(self.cfg.nnodes)}
        return [n for n in self.nodes if n.name in held and not n.lost]

    def _lose(self, node: _Node) -> None:
        """The node is gone: its supervisor and workers at once, then its tier-1 disk (what
        it logged there is kept first, as a cluster's log shipping would: the heals it
        took part in are judged from it)."""
        node.lost = True
        os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait()
        p = node.root / layout.EVENTS
        self._shipped += ev.read_events(p) if p.is_file() else []
        shutil.rmtree(node.root, ignore_errors=True)
        shutil.rmtree(default_root(node.root), ignore_errors=True)  # its Tier0() RAM

    def _finish(self) -> int:
        """Wait for every node left; the first non-zero status, else 0."""
        end = time.monotonic() + self.cfg.job_timeout_s
        codes = []
        for n in self.nodes:
            if not n.lost:
                codes.append(n.proc.wait(max(1.0, end - time.monotonic())))
        return next((c for c in codes if c != 0), 0)

    # -- eyes -------------------------------------------------------------------------------
    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Every node's events: the live nodes' and what the lost ones logged till then."""
        out = list(self._shipped)
        for n in self.nodes:
            p = n.root / layout.EVENTS
            out += ev.read_events(p) if p.is_file() else []
        return [e for e in out if kind is None or e["event"] == kind]

    def rows(self) -> list[dict[str, Any]]:
        if not self.losses.is_file():
            return []
        return [json.loads(x) for x in self.losses.read_text().splitlines() if x.strip()]

    def _wait(self, what: str, cond: Callable[[], bool]) -> None:
        end = time.monotonic() + self.cfg.job_timeout_s
        while not cond():
            ended = [n.name for n in self.nodes if not n.lost and n.proc.poll() is not None]
            if ended:
                rows = self.rows()
                last = max((int(r["step"]) for r in rows), default=-1)
                why = (f"; the job had trained every step ({last}) by then: its steps outrun "
                       "the drill's faults (give more --steps, or slower steps, e.g. "
                       "examples/train.py --step-sleep 0.1)"
                       if last >= self.cfg.steps - 1 else "")
                raise TimeoutError(f"node(s) {', '.join(ended)} ended before {what}{why}")
            if time.monotonic() > end:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(_POLL_S)

    # -- faults -----------------------------------------------------------------------------
    def _fault(self, kind: str, at: int, *, after: int) -> dict[str, Any]:
        self._wait(f"step {at}", lambda: len(self.rows()) > at)
        catalog = Tier2Catalog(self._tier2)
        self._wait(f"a checkpoint after step {after} on tier 2", lambda: max(
            catalog.complete_steps(), default=-1) > after)
        running = self._running()
        if kind == "store_node":  # a node that hosts a live member of the drill's etcd
            running = [n for n in running if (m := _member(n.name)) is not None
                       and self.private is not None and self.private.alive(m)]
        victims = self.rng.sample(running, _LOST[kind])
        slots = {self._holder(s): s for s in range(self.cfg.nnodes)}
        t_kill = time.time()
        for node in victims:
            self._lose(node)
        member = _member(victims[0].name) if kind == "store_node" else None
        if member is not None and self.private is not None:
            self.private.kill(member)  # with its node
        slot = slots[victims[0].name]
        if kind == "spare_lost":  # the spare node that takes the slot, lost as it loads
            self._wait(f"a spare node to take slot {slot}",
                       lambda: self._holder(slot) not in ("", victims[0].name))
            holder = self._holder(slot)  # one read: the store, not once per node
            taker = next(n for n in self.nodes if n.name == holder)
            self._lose(taker)
            victims.append(taker)
        if kind in ("no_spare", "spare_lost"):
            self._wait(f"slot {slot} freed", lambda: self._holder(slot) == "")
            self._start(f"{victims[0].name}-again")
        self._wait("a step after it", lambda: any(float(r["t"]) > t_kill
                                                  for r in self.rows()))
        return {"kind": kind, "at_step": at, "nodes": [n.name for n in victims],
                "slots": sorted(slots[n.name] for n in victims if n.name in slots),
                "t_kill": t_kill,
                **({"etcd_member": f"m{member}"} if member is not None else {})}


def _member(node: str) -> int | None:
    """The etcd member node ``n<i>`` hosts (i < :data:`ETCD_MEMBERS`); spares host none."""
    i = node.removeprefix("n")
    return int(i) if node.startswith("n") and i.isdigit() and int(i) < ETCD_MEMBERS else None


def _report(cfg: NodeDrillConfig, ref: RunResult, run: _NodesRun,
            faults: list[dict[str, Any]]) -> dict[str, Any]:
    per_fault, verdicts = judge(ref, run.rows(), run.events(), faults, steps=cfg.steps,
                                world=cfg.nnodes * cfg.nproc, expected=NODE_FAULTS,
                                planned=len(cfg.faults), rc=run.rc)
    return {"drill": "heal-nodes",
            "config": {**dataclasses.asdict(cfg), "out": str(cfg.out)},
            "faults": per_fault, "verdicts": verdicts,
            "ok": all(v["ok"] for v in verdicts.values())}


def _markdown(doc: dict[str, Any]) -> str:
    lines = ["# Node-loss heal drill", "", "| fault | at step | nodes (slots) | outcome | "
             "R (s) | restored step | ok |", "|---|---|---|---|---|---|---|"]
    for f in doc["faults"]:
        r = f.get("R_s")
        where = f"{', '.join(f.get('nodes', []))} ({f.get('slots', '—')})" + (
            f" + etcd {f['etcd_member']}" if f.get("etcd_member") else "")
        lines.append(f"| {f['kind']} | {f.get('at_step', '—')} | {where} | {f['outcome']} | "
                     f"{'—' if r is None else f'{r:.2f}'} | {f.get('restored_step', '—')} | "
                     f"{'yes' if f['ok'] else 'NO'} |")
    lines += ["", "| verdict | ok | detail |", "|---|---|---|"]
    lines += [f"| {k} | {'yes' if v['ok'] else 'NO'} | {v['detail']} |"
              for k, v in doc["verdicts"].items()]
    return "\n".join(lines) + "\n"
