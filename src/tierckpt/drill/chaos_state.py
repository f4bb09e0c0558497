"""The chaos drill's state and its eyes on the running job.

:class:`ChaosState` holds everything the drill knows about the one job (its starts, the
cycle being recorded, the tier-1 step directories seen, excused and damaged, the RAM
copies damaged, the tier-2 outage in effect) and offers what every later stage builds on,
none of which injects a fault or judges a restore:

- **starts**: :attr:`ChaosState.cur`, ``_running``, ``_launch`` (one more start of the job,
  with what the drill knew when it launched it) and ``_down`` (a start is over: wait for
  every process of the job, kill what outlives :data:`QUIET_S`, free a filled tier 1, and
  record where each save-time kill landed);
- **waiting and watching**: ``_tick`` (poll the event tails, sample tier-1 peaks, end a
  tier-2 outage once it was felt or lasted long enough), ``_wait``/``_wait_running`` and the
  event queries (commits, a rank's pid, tier 2's complete steps, None while it is down);
- **node RAM** (with tier 0): each node's tier-0 root (:func:`ram_root`), what it holds
  and what each node can restore from it (``_ram``);
- **records**: the fault facts, the crash-loop launch records and the report's config and
  cycle documents.

Waits return a status and never raise; storage trouble while listing tier 2 reads as None.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_objects as co
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.chaos_config import (
    QUIET_S,
    SAMPLE_S,
    SETTLE_S,
    ChaosConfig,
    CycleRecord,
    StartRecord,
)
from tierckpt.drill.drills import Progress
from tierckpt.drill.inject import last_step
from tierckpt.drill.launch import Job, JobSpec
from tierckpt.errors import CheckpointError
from tierckpt.format import layout
from tierckpt.runtime import events as ev
from tierckpt.tier0.root import PEER_DIR, default_root
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage
from tierckpt.tier2.storage.url import parse_url

__all__ = ["ChaosState", "ram_root"]

_POLL_S = 0.02
_FELT = (ev.UPLOAD_FAILED, ev.TIER2_UNHEALTHY, ev.TIER2_UNAVAILABLE)


def ram_root(cfg: ChaosConfig, node_root: Path) -> Path | None:
    """Where the job keeps the node's tier 0: ``Tier0()``'s default root for the node's
    tier-1 root, ``<tier0>/<run>-node<i>`` under a directory, None without tier 0."""
    if cfg.tier0 is None:
        return None
    if cfg.tier0 == "auto":
        return default_root(node_root)
    return Path(cfg.tier0) / f"{node_root.parent.name}-{node_root.name}"


def ram_arg(cfg: ChaosConfig, roots: tuple[Path, ...]) -> tuple[str, ...] | None:
    """The ``--tier0`` value of each node of a job on ``roots`` (None without tier 0)."""
    if cfg.tier0 is None:
        return None
    return tuple("auto" if cfg.tier0 == "auto" else str(ram_root(cfg, r)) for r in roots)


class ChaosState:
    """The drill's knowledge of one job on ``cfg.nnodes`` simulated nodes, and its waits."""

    def __init__(self, cfg: ChaosConfig, progress: Progress) -> None:
        self.cfg, self.progress = cfg, progress
        self.base = cfg.out / "runs" / "chaos"
        self.roots = [self.base / f"node{i}" for i in range(cfg.nnodes)]
        self.marker = str(self.base / "node")
        self.tails = [cf.EventTail(r / layout.EVENTS, i) for i, r in enumerate(self.roots)]
        assert cfg.tier2 is not None
        self.url = cfg.tier2
        u = parse_url(cfg.tier2)
        self.outage = cf.Tier2Outage(Path(u.location)) if u.scheme == "file" else None
        self.t2_root = Path(u.location) if u.scheme == "file" else None
        self.t2_damaged: dict[str, int] = {}  # content objects the drill damaged → their node
        self.t2_verified: set[int] = set()  # tier-2 steps verified in full (--dedup)
        self.outage_t, self.outage_min, self.outage_marks = 0.0, 0.0, [0] * cfg.nnodes
        self.outage_fact: dict[str, Any] | None = None
        self.outage_hold = False  # held until the restarted job has restored
        self.starts: list[StartRecord] = []
        self.cycles: list[CycleRecord] = []
        self.rec = self.first = CycleRecord(None, 0)
        self.seen: dict[int, set[int]] = {n: set() for n in range(cfg.nnodes)}
        self.excused: dict[int, set[int]] = {n: set() for n in range(cfg.nnodes)}
        self.broken: dict[int, set[int]] = {n: set() for n in range(cfg.nnodes)}
        # damaged on disk (the scrub finds them) yet safe to restore: a manifest.json gone
        # from beside its parts (chaos_faults.rebuilt_from_parts)
        self.readable: dict[int, set[int]] = {n: set() for n in range(cfg.nnodes)}
        self.rams = [ram_root(cfg, r) for r in self.roots]  # None entries without tier 0
        self.ram_damaged: dict[int, set[tuple[str, int]]] = {n: set() for n in
                                                             range(cfg.nnodes)}
        self.identity: dict[tuple[int, str, int], int] = {}  # damaged copy → its dir's inode
        self.left_broken: set[tuple[int | str, int]] = set()
        self.tier2_ok: set[int] = set()  # tier-2 copies of damaged steps that verified
        self.peaks: dict[int, int] = {n: 0 for n in range(cfg.nnodes)}
        self.kills: list[tuple[dict[str, Any], int | None]] = []
        self.filler: Path | None = None
        self.mounted: list[Path] = []
        self.catalogue: dict[str, dict[str, Any]] = {}
        self.ref_rows: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}
        self.save_every, self.keep_last = 1, 3
        self.backlog: int | None = None
        self._sampled = 0.0

    # -- starts ---------------------------------------------------------------------------
    @property
    def cur(self) -> StartRecord:
        return self.starts[-1]

    def _running(self) -> bool:
        return bool(self.starts) and self.cur.job.running()

    def _launch(self, rec: CycleRecord) -> StartRecord:
        cfg, g = self.cfg, len(self.starts)
        for root in self.roots:
            root.mkdir(parents=True, exist_ok=True)
        spec = JobSpec(name=f"start{g}", command=cfg.command, roots=tuple(self.roots),
                       losses=self.base / f"losses-{g}.jsonl", steps=cfg.total_steps,
                       nproc=cfg.nproc, tier2=self.url, tier0=ram_arg(cfg, tuple(self.roots)),
                       heal=cfg.heal, max_restarts=cfg.cycles if cfg.heal else 0)
        start = StartRecord(index=g, cycle=rec.index, job=Job(spec), losses=spec.losses,
                       t_launch=time.time(), marks=[len(t.events) for t in self.tails],
                       complete={n: cf.step_dirs(r)[0] for n, r in enumerate(self.roots)},
                       broken={n: s - self.readable[n] for n, s in self.broken.items()},
                       views=[self._tier2_steps()], ram=self._ram(),
                       ram_damaged={n: set(s) for n, s in self.ram_damaged.items()},
                       t2_broken=self._t2_broken())
        start.job.start()
        self.starts.append(start)
        rec.starts.append(g)
        return start

    def _down(self, rec: CycleRecord, start: StartRecord, end: str) -> None:
        """The start is over: wait for its agents, then for every process of the job."""
        rc = start.job.wait(SETTLE_S)
        start.rc = rc
        start.end = "finished" if rc == 0 and end != "crash" and \
            last_step(start.losses) >= self.cfg.total_steps - 1 else end
        left = self._quiet()
        if left:
            rec.verdicts.append(cv.Verdict("processes", False, f"{len(left)} process(es) of "
                                           f"the job outlived it by {QUIET_S:.0f} s: "
                                           f"{left[0][:160]}", {"left": left}))
        self._free_fill()
        for fact, save_step in self.kills:
            if save_step is not None and "landed" not in fact:
                fact["landed"] = self._landed(fact, save_step)
        self.kills = []

    def _landed(self, fact: dict[str, Any], step: int) -> str:
        """Where a kill in a save landed: the save's commit on every node (tier 1 or RAM),
        some or none; for a killed partner, whether the replica it received committed."""
        own, held = self._ram_held()
        if fact["kind"] == "kill_partner":
            return "replica_committed" if step in held[fact["holder"]] else "replica_torn"
        done = [n for n, r in enumerate(self.roots) if step in cf.step_dirs(r)[0] | own[n]]
        return ("after_commit" if len(done) == len(self.roots) else
                "partial_commit" if done else "before_commit")

    def _quiet(self) -> list[str]:
        self._wait(lambda: not cf.processes(self.marker), QUIET_S, poll_s=0.2)
        left = cf.processes(self.marker)
        for pid, _ in left:
            cf.kill(pid)
        return [cmd for _, cmd in left]

    def _free_fill(self) -> None:
        if self.filler is not None:
            with contextlib.suppress(FileNotFoundError):
                self.filler.unlink()
            self.filler = None

    # -- node RAM ---------------------------------------------------------------------------
    def _ram_held(self) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """Per node: the complete steps of its own tier 0, and of the replica it holds."""
        own: dict[int, set[int]] = {}
        held: dict[int, set[int]] = {}
        for n, ram in enumerate(self.rams):
            own[n], held[n] = cf.ram_steps(ram) if ram is not None else (set(), set())
        return own, held

    def _ram(self, damaged: dict[int, set[tuple[str, int]]] | None = None
             ) -> dict[int, set[int]]:
        """Per node, the steps it can restore from RAM now (its own or its partner's copy,
        not one the drill damaged, or ``damaged`` when given)."""
        own, held = self._ram_held()
        return cv.ram_restorable(own, held, self.ram_damaged if damaged is None else damaged)

    def _copy_dir(self, node: int, where: str, step: int) -> Path:
        """The directory of a copy: ``where`` is ``tier1``, ``own`` (RAM) or ``replica``."""
        name = layout.step_dirname(step)
        if where == "tier1":
            return self.roots[node] / name
        ram = self.rams[node]
        assert ram is not None
        return ram / name if where == "own" else ram / PEER_DIR / name

    def _mark_damaged(self, node: int, where: str, step: int) -> None:
        with contextlib.suppress(OSError):
            self.identity[(node, where, step)] = self._copy_dir(node, where, step).stat().st_ino

    def _still_damaged(self, node: int, where: str, step: int) -> bool:
        """The copy the drill damaged is still at its name (not set aside, removed, or
        replaced by a fresh copy of the same step, e.g. one fetched from tier 2)."""
        try:
            ino = self._copy_dir(node, where, step).stat().st_ino
        except OSError:
            return False
        return self.identity.get((node, where, step)) == ino

    # -- waiting and watching -------------------------------------------------------------
    def _tick(self, force: bool = False) -> None:
        for t in self.tails:
            t.poll()
        now = time.monotonic()
        if force or now - self._sampled >= SAMPLE_S:
            self._sampled = now
            for n, root in enumerate(self.roots):
                complete, tmp = cf.step_dirs(root)
                self.seen[n] |= complete
                count = len(complete) + tmp
                self.peaks[n] = max(self.peaks[n], count)
                self.rec.peaks[n] = max(self.rec.peaks.get(n, 0), count)
        self._maybe_end_outage(now)

    def _wait(self, pred: Callable[[], bool], timeout_s: float, *,
              poll_s: float = _POLL_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self._tick()
            if pred():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)

    def _wait_running(self, pred: Callable[[], bool], timeout_s: float, *,
                      poll_s: float = _POLL_S) -> str:
        """``"ok"`` once ``pred()``; ``"ended"`` when the job stopped first; ``"stalled"``
        after ``timeout_s``."""
        ended = [False]

        def done() -> bool:
            if pred():
                return True
            ended[0] = not self._running()
            return ended[0]
        if not self._wait(done, timeout_s, poll_s=poll_s):
            return "stalled"
        return "ended" if ended[0] and not pred() else "ok"

    def _maybe_end_outage(self, now: float) -> None:
        o = self.outage
        if o is None or not o.down:
            return
        elapsed = now - self.outage_t
        if elapsed < self.outage_min or self.outage_hold:
            return
        felt = any(e["event"] in _FELT for t, i in zip(self.tails, self.outage_marks,
                                                       strict=True) for e in t.events[i:])
        if felt or elapsed >= 2 * self.outage_min:
            o.end()
            if self.outage_fact is not None:
                self.outage_fact["detail"] += (f"; back after {elapsed:.1f} s"
                                               f"{' (uploads failed meanwhile)' if felt else ''}")
            if self.starts and not self.cur.checked:
                self.cur.views.append(self._tier2_steps())

    def _wait_outage_over(self, rec: CycleRecord) -> None:
        if self.outage is not None and self.outage.down:
            self._wait(lambda: not self.outage.down if self.outage else True,
                       4 * max(self.outage_min, 1.0) + 5)
            if self.outage.down:
                self.outage.end()
                rec.notes.append("tier 2 brought back at the end of its cycle")

    def _events(self, start: StartRecord, kind: str) -> list[dict[str, Any]]:
        return [e for t, i in zip(self.tails, start.marks, strict=True)
                for e in t.events[i:] if e["event"] == kind]

    def _commits(self, start: StartRecord) -> set[int]:
        """Steps this start committed on every node."""
        per_node = [{int(e["step"]) for e in t.events[i:] if e["event"] == ev.SAVE_COMMITTED}
                    for t, i in zip(self.tails, start.marks, strict=True)]
        return set.intersection(*per_node)

    def _committed_new(self, start: StartRecord) -> bool:
        floor = -1 if start.restored is None else start.restored
        return start.checked and any(s > floor for s in self._commits(start))

    def _commits_after(self, n: int) -> str:
        return self._wait_running(lambda: len(self._commits(self.cur)) >= n,
                                  self.cfg.commit_timeout_s)

    def _rank_pid(self, start: StartRecord, node: int) -> int | None:
        """The pid of the node's first rank: from its ``process_start`` event, else (the
        line was lost, e.g. on a full disk) the node's agent's only worker."""
        rank = node * self.cfg.nproc
        pids = [int(e["pid"]) for e in self._events(start, ev.PROCESS_START)
                if e.get("rank") == rank and isinstance(e.get("pid"), int)]
        if pids:
            return pids[-1]
        workers = cf.children(start.job.procs[node].pid, str(self.roots[node]))
        return workers[0] if len(workers) == 1 else None

    def _tier2_steps(self, *, through_outage: bool = False) -> frozenset[int] | None:
        """Complete tier-2 steps; None while tier 2 is down (unless ``through_outage``:
        then what it will hold once back) or cannot be listed."""
        url = self.url
        if self.outage is not None and self.outage.down:
            if not through_outage:
                return None
            url = f"file://{self.outage.away}"
        try:
            with open_storage(url) as storage:
                return frozenset(Tier2Catalog(storage).complete_steps())
        except (CheckpointError, OSError):
            return None

    def _t2_dir(self) -> Path:
        """The ``file://`` tier 2's directory, where it is now (renamed away in an outage)."""
        assert self.t2_root is not None
        return self.outage.away if self.outage is not None and self.outage.down \
            else self.t2_root

    def _t2_broken(self, damaged: dict[str, int] | None = None) -> dict[int, set[int]]:
        """Per node, the complete tier-2 steps whose map names a content object of that
        node's files the drill damaged (``damaged``, default all so far): a later step that
        has the same bytes skips the upload and shares the damage."""
        damaged = self.t2_damaged if damaged is None else damaged
        if not damaged:
            return {}
        out: dict[int, set[int]] = {n: set() for n in range(self.cfg.nnodes)}
        for step, members in co.tier2_maps(self._t2_dir()).items():
            for key in set(members.values()) & set(damaged):
                out[damaged[key]].add(step)
        return out

    # -- records --------------------------------------------------------------------------
    def _rtol(self) -> float:
        return self.cfg.rtol if self.cfg.rtol is not None else 0.0

    def _log_kill(self, node: int, pid: int, detail: str) -> None:
        """Record a SIGKILL the drill sent to node ``node``'s job as ``failure_detected``
        (``how: kill``, ``source: drill``) in the node's event log, as its first rank; a log
        the drill cannot write (a full disk) is skipped."""
        with contextlib.suppress(OSError), \
                ev.EventLog(self.roots[node] / layout.EVENTS, rank=node * self.cfg.nproc) as log:
            log.emit(ev.FAILURE_DETECTED, how="kill", detail=f"chaos drill {detail}",
                     victim_pid=pid, source="drill")

    def _fact(self, f: cv.Fault, *, fired: bool, detail: str) -> dict[str, Any]:
        return {"label": f.label, "kind": f.kind, "node": f.node, "variant": f.variant,
                "fired": fired, "t": time.time(), "detail": detail}

    def _launch_record(self, s: StartRecord) -> cv.Launch:
        committed = s.checked and (s.t_commit is not None or self._committed_new(s))
        return cv.Launch(index=s.index, restored=s.restored, committed=committed, end=s.end,
                         final_step=self.cfg.total_steps - 1, excused=s.excused)

    def _cycle_doc(self, c: CycleRecord) -> dict[str, Any]:
        merged: dict[str, cv.Verdict] = {}
        for v in c.verdicts:  # one per invariant: the first failure, else the last pass
            if v.name not in merged or (merged[v.name].ok and not v.ok) or \
                    (merged[v.name].ok and v.ok):
                merged[v.name] = v
        return {"index": c.index, "plan": c.plan.as_dict() if c.plan else None,
                "kinds": list(c.plan.kinds) if c.plan else [], "faults": c.faults,
                "starts": c.starts, "resumed": c.resumed, "recovery_s": c.recovery_s,
                "peaks": c.peaks, "notes": c.notes,
                "verdicts": {k: {"ok": v.ok, "detail": v.detail} for k, v in merged.items()},
                "violations": [k for k, v in merged.items() if not v.ok],
                "violation_facts": {k: v.facts for k, v in merged.items() if not v.ok}}

    def _config_doc(self) -> dict[str, Any]:
        c = self.cfg
        return {"command": list(c.command), "cycles": c.cycles, "nnodes": c.nnodes,
                "nproc": c.nproc, "world_size": c.world_size, "steps": c.total_steps,
                "seed": c.seed, "tier2": c.tier2, "tier0": c.tier0, "preempt": c.preempt,
                "heal": c.heal, "dedup": c.dedup,
                "kinds": list(c.kinds),
                "out": str(c.out),
                "roots": [str(r) for r in self.roots]}
