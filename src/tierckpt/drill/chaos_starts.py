"""The chaos drill's starts of the job and the checks between them.

:class:`StartRunner` brings the job back and judges it:

- ``_recover`` starts the job until a start restores and commits (a start refused while
  tier 2 is down and a node needs it is excused and retried once tier 2 is back), and
  raises CheckpointError after ``max_starts`` failures;
- ``_check_restore`` records the resume verdict once every rank chose, and
  ``_resolve_broken`` what became of the steps the drill damaged;
- ``_phase``/``_unexpected`` run a wait of the running job and, when it ends on its own or
  stalls meanwhile, record that and start it again (CheckpointError when it keeps ending or
  ran out of steps);
- ``_snapshot`` (integrity and retention with nothing running) and ``_close`` (losses, disk
  bound, crash loop) append a cycle's verdicts.

Every verdict is a pure function of :mod:`tierckpt.drill.chaos_verdicts` over what was
recorded; a violated one is recorded, never raised.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable
from typing import Any

from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.chaos_config import SETTLE_S, CycleRecord, StartRecord
from tierckpt.drill.chaos_state import ChaosState
from tierckpt.drill.inject import last_step, read_jsonl
from tierckpt.errors import CheckpointError
from tierckpt.format import layout
from tierckpt.ops.check import check_tier1
from tierckpt.runtime import events as ev

__all__ = ["StartRunner"]

_ERROR_LINE = re.compile(r"\b\w+(Error|Exception): ")


class StartRunner(ChaosState):
    """Starts of the job until one commits, and the verdicts on each restore and at rest."""

    # -- starts until one commits --------------------------------------------------------
    def _phase(self, rec: CycleRecord, wait: Callable[[], str], what: str) -> None:
        """Run a wait of the running job; when the job ends on its own (or stalls) meanwhile,
        record that, restart it and wait again."""
        for _ in range(self.cfg.max_starts):
            status = wait()
            if status == "ok":
                return
            self._unexpected(rec, status, what)
        raise CheckpointError(f"cycle {rec.index}: waiting for {what}, the job kept ending")

    def _unexpected(self, rec: CycleRecord, status: str, what: str) -> None:
        start = self.cur
        if status == "stalled":
            rec.notes.append(f"start {start.index} stalled waiting for {what}; stopped")
            start.job.kill()
        rc = start.job.wait(SETTLE_S)
        if rc == 0 and last_step(start.losses) >= self.cfg.total_steps - 1:
            self._down(rec, start, "finished")
            raise CheckpointError(f"ran out of steps in cycle {rec.index} (waiting for {what}): "
                                  "the job finished training; give more --steps")
        rec.notes.append(f"start {start.index} exited ({rc}) on its own waiting for {what}")
        self._down(rec, start, "crash")
        self._snapshot(rec)
        self._recover(rec)

    def _recover(self, rec: CycleRecord) -> None:
        """Start the job until a start restores and commits; a start that fails while tier
        2 is down and a node needs it is excused (refusing is right), and retried once tier
        2 is back."""
        failures, excused = 0, 0
        while failures < self.cfg.max_starts and excused < self.cfg.max_starts:
            if self.outage is not None and self.outage.down and excused:
                self._wait_outage_over(rec)
            start = self._launch(rec)
            self._check_restore(rec, start)
            self.outage_hold = False
            status = self._wait_running(functools.partial(self._committed_new, start),
                                        self.cfg.commit_timeout_s)
            if status == "ok":
                start.t_commit = time.time()
                if rec.t_fault is not None and rec.recovery_s is None:
                    rec.recovery_s = start.t_commit - rec.t_fault
                return
            if status == "stalled":
                start.job.kill()
            self._down(rec, start, "crash")
            if start.views[0] is None and cv.expected_restore(start.complete, start.broken,
                                                              None) == "refuse":
                start.excused = "tier 2 was down and a node could restore only from it"
                excused += 1
            else:
                failures += 1
            rec.notes.append(f"start {start.index} {status} before committing (exit "
                             f"{start.rc}){': ' + start.excused if start.excused else ''}: "
                             f"{_last_lines(start.job.tail(20000))}")
            self._snapshot(rec)
        raise CheckpointError(f"cycle {rec.index}: the job did not come back after "
                              f"{len(rec.starts)} starts")

    def _check_restore(self, rec: CycleRecord, start: StartRecord) -> None:
        """Once every rank chose: the resume verdict, then what became of damaged steps."""
        world = range(self.cfg.world_size)

        def chosen() -> dict[int, Any]:
            return {int(e["rank"]): e.get("step") for e in self._events(start,
                    ev.CHECKPOINT_CHOSEN) if e.get("rank") in world}
        self._wait_running(lambda: len(chosen()) == len(world), self.cfg.commit_timeout_s)
        picks = chosen()
        if len(picks) < len(world):
            return  # it died or stalled before restoring: the crash-loop verdict says so
        steps = set(picks.values())
        if steps != {None}:
            self._wait_running(lambda: len({e.get("rank") for e in self._events(
                start, ev.RESTORE_DONE)}) >= len(world), 60.0)
        tier2_bytes = {int(e["rank"]): int((e.get("bytes_by_source") or {}).get("tier2", 0))
                       for e in self._events(start, ev.RESTORE_DONE)}
        start.views.append(self._tier2_steps())
        seen = [v for v in start.views if v is not None]
        views: list[frozenset[int] | None] = [*start.views, frozenset().union(*seen)]
        acceptable = {cv.expected_restore(start.complete, start.broken, v) for v in views}
        step = next(iter(steps)) if len(steps) == 1 else None
        lacking = {n: {s for s in steps if isinstance(s, int) and
                       (s not in start.complete[n] or s in start.broken[n])}
                   for n in range(self.cfg.nnodes)}
        v = cv.resume_verdict(picks, acceptable, tier2_bytes=tier2_bytes, lacking=lacking,
                              node_of={r: r // self.cfg.nproc for r in world})
        rec.verdicts.append(v)
        rec.resumed.append({"start": start.index, "step": step, "acceptable": v.facts[
            "acceptable"], "tier2_bytes": tier2_bytes, "ok": v.ok})
        start.restored, start.checked = step, True
        self._resolve_broken(step, tier2_bytes)

    def _resolve_broken(self, step: int | None, tier2_bytes: dict[int, int]) -> None:
        """After a restore: a damaged step newer than the restore point must have been set
        aside; the restored one, if damaged, was fetched; older ones were not looked at."""
        for n, steps in self.broken.items():
            for s in sorted(steps):
                there = os.path.lexists(self.roots[n] / layout.step_dirname(s))
                if not there or s == step:
                    steps.discard(s)
                elif step is None or s > step:
                    self.left_broken.add((n, s))
                    steps.discard(s)

    # -- checks at rest -------------------------------------------------------------------
    def _snapshot(self, rec: CycleRecord) -> None:
        """Nothing runs: every complete checkpoint (but those the drill damaged and no
        restore needed to look at) verifies in full; nothing retained went missing."""
        self._tick(force=True)
        now = {n: cf.step_dirs(r)[0] for n, r in enumerate(self.roots)}
        checks = []
        for n, steps in now.items():
            for s in sorted(steps - self.broken[n]):
                r = check_tier1(self.roots[n], s)
                checks.append((n, s, r.ok, r.error))
        rec.verdicts.append(cv.integrity_verdict(checks, self.left_broken))
        self.left_broken = set()
        excused = {n: self.excused[n] | {int(e["step"]) for e in t.events if e["event"] ==
                                         ev.CHECKPOINT_SKIPPED and isinstance(e.get("step"), int)}
                   for n, t in enumerate(self.tails)}
        rec.verdicts.append(cv.retained_verdict(self.seen, now, excused=excused,
                                                keep_last=self.keep_last))

    def _close(self, rec: CycleRecord, *, complete: bool = False) -> None:
        rows = [read_jsonl(s.losses) for s in self.starts]
        rec.verdicts.append(cv.losses_verdict(self.ref_rows, rows, rtol=self._rtol(),
                                              complete=complete))
        rec.verdicts.append(cv.disk_verdict(rec.peaks, cv.tier1_bound(self.keep_last,
                                                                      self.backlog)))
        mine = [s for s in self.starts if s.index in rec.starts or s.index == rec.prev]
        rec.verdicts.append(cv.crash_loop_verdict([self._launch_record(s) for s in mine]))


def _last_lines(text: str, n: int = 3) -> str:
    """The job's exception line(s) if its log has one, else its last lines."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("---")]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and "ChildFailedError" not in ln]
    return " | ".join(dict.fromkeys(errors[-n:] or lines[-n:]))[-600:]

