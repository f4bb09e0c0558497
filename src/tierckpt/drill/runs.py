"""Run one training job of a drill and collect what it recorded (losses, events, timing).

Also the file chores the drills need around runs: pick and copy a committed checkpoint into
a fresh tier-1 root (reshard), drain the uploader and wipe tier-1 roots (tier 2 only).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt.drill.inject import KillRecord, kill_at_step, read_jsonl
from tierckpt.drill.launch import Job, JobSpec
from tierckpt.drill.verdicts import KillPlan
from tierckpt.errors import CheckpointError
from tierckpt.format import layout
from tierckpt.runtime import events as ev
from tierckpt.tier0.root import default_root
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

__all__ = ["RunResult", "choose_mid_checkpoint", "drain_and_wipe", "restore_summary", "run_job",
           "seed_root"]


@dataclass
class RunResult:
    """One finished job: exit status, rank 0's loss rows, every node's events, wall times."""

    name: str
    rc: int
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    t_start: float
    t_end: float
    log_tail: str = ""
    kill: KillRecord | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Events of one kind, in time order."""
        return sorted((e for e in self.events if e.get("event") == kind),
                      key=lambda e: float(e["t"]))


def run_job(spec: JobSpec, *, timeout_s: float, kill: KillPlan | None = None,
            act: Callable[[Job], None] | None = None) -> RunResult:
    """Run ``spec`` to the end (killing ``kill.rank`` after ``kill.step`` if given; calling
    ``act(job)`` once the agents are started, e.g. to send a notice).

    Never raises for a failed job: the result's ``rc`` and ``log_tail`` say what happened
    (a kill that could not be placed, or an ``act`` that raised CheckpointError, is
    ``rc = -1`` with the reason in ``notes["kill_error"]``).
    """
    for root in spec.roots:
        root.mkdir(parents=True, exist_ok=True)
    spec.losses.parent.mkdir(parents=True, exist_ok=True)
    record: KillRecord | None = None
    notes: dict[str, Any] = {}
    with Job(spec) as job:
        rc = 0
        if kill is not None:
            try:
                record = kill_at_step(kill, losses=spec.losses,
                                      event_logs=[r / layout.EVENTS for r in spec.roots],
                                      alive=job.running, timeout_s=timeout_s)
            except CheckpointError as e:
                notes["kill_error"] = str(e)
                rc = -1
        if act is not None:
            try:
                act(job)
            except CheckpointError as e:
                notes["kill_error"] = str(e)
                rc = -1
        rc = job.wait(timeout_s) or rc
        tail = job.tail() if rc else ""
        t_start = job.started_at
    events = [e for r in spec.roots for e in read_jsonl(r / layout.EVENTS)]
    events.sort(key=lambda e: float(e.get("t", 0.0)))
    return RunResult(name=spec.name, rc=rc, rows=read_jsonl(spec.losses), events=events,
                     t_start=t_start, t_end=time.time(), log_tail=tail, kill=record,
                     notes=notes)


def choose_mid_checkpoint(roots: list[Path], *, steps: int, min_after: int = 2) -> int:
    """The newest step complete on every root that leaves ``min_after`` steps to train,
    else the oldest complete step. CheckpointError when the roots share none."""
    common = set.intersection(*(set(Tier1Catalog(r).complete_steps()) for r in roots)) \
        if roots else set()
    if not common:
        raise CheckpointError(f"no checkpoint is complete on every tier-1 root {roots}")
    fits = [s for s in common if s <= steps - 1 - min_after]
    return max(fits) if fits else min(common)


def seed_root(sources: list[Path], step: int, dest: Path) -> None:
    """A fresh tier-1 root holding only checkpoint ``step``, merged from every node's root
    (node-local roots each hold their own shard files)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    name = layout.step_dirname(step)
    for src in sources:
        shutil.copytree(src / name, dest / name, dirs_exist_ok=True)


def drain_and_wipe(roots: list[Path], tier2: str, *, timeout_s: float = 600.0) -> list[int]:
    """Upload what is due from every root (``python -m tierckpt.uploader`` once each), check
    tier 2 holds a complete checkpoint, then delete every tier-1 root. Returns the tier-2
    steps. CheckpointError when an upload fails or tier 2 ends up empty."""
    for root in roots:
        # its own process: the uploader lowers its CPU/I/O priority and installs signal
        # handlers, neither of which the drill (or a test process) should inherit
        proc = subprocess.run([sys.executable, "-m", "tierckpt.uploader", str(root), tier2],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s)
        if proc.returncode != 0:
            raise CheckpointError(f"tier-2 drill: uploading {root} to {tier2} failed "
                                  f"(exit {proc.returncode}): {proc.stderr[-1500:]}")
    with open_storage(tier2) as storage:
        remote = Tier2Catalog(storage).complete_steps()
    if not remote:
        raise CheckpointError(f"tier-2 drill: {tier2} holds no complete checkpoint after "
                              "draining the uploader")
    for root in roots:
        shutil.rmtree(root)
        shutil.rmtree(default_root(root), ignore_errors=True)  # its Tier0() RAM too
    return remote


def restore_summary(run: RunResult) -> dict[str, Any] | None:
    """The run's restore: step, source, the slowest rank's seconds, bytes summed over ranks."""
    done = run.of(ev.RESTORE_DONE)
    if not done:
        return None
    slowest = max(done, key=lambda e: float(e.get("seconds", 0.0)))
    out = {k: slowest.get(k) for k in ("step", "seconds", "source", "world_size",
                                       "saved_world_size")}
    by_source: dict[str, int] = {}
    for e in done:
        for src, n in (e.get("bytes_by_source") or {}).items():
            by_source[src] = by_source.get(src, 0) + int(n)
    out["bytes_by_source"] = by_source  # summed over ranks
    out["bytes"] = sum(int(e.get("bytes", 0)) for e in done)
    return out
