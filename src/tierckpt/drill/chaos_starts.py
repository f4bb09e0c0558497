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
import re
import time
from collections.abc import Callable
from typing import Any

from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_objects as co
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.chaos_config import SETTLE_S, CycleRecord, StartRecord
from tierckpt.drill.chaos_state import ChaosState
from tierckpt.drill.inject import last_step, read_jsonl
from tierckpt.errors import CheckpointError
from tierckpt.ops.check import check_tier1, check_tier2
from tierckpt.runtime import events as ev
from tierckpt.tier0.root import PEER_DIR
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

__all__ = ["StartRunner"]

_ERROR_LINE = re.compile(r"\b\w+(Error|Exception): ")
_RAM_LABEL = {"own": "RAM", "replica": "replica"}


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
            if start.views[0] is None and cv.expected_restore(
                    start.complete, start.broken, None, start.ram) == "refuse":
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
        if set(picks.values()) != {None}:
            self._wait_running(lambda: len({e.get("rank") for e in self._events(
                start, ev.RESTORE_DONE)}) >= len(world), 60.0)
            picks = chosen()  # a step whose fetch found tier 2's copy damaged is chosen again
        steps = set(picks.values())
        read = {int(e["rank"]): {str(k): int(v) for k, v in
                                 (e.get("bytes_by_source") or {}).items()}
                for e in self._events(start, ev.RESTORE_DONE)}
        start.views.append(self._tier2_steps())
        seen = [v for v in start.views if v is not None]
        views: list[frozenset[int] | None] = [*start.views, frozenset().union(*seen)]
        acceptable = {cv.expected_restore(start.complete, start.broken, v, start.ram,
                                          start.t2_broken) for v in views}
        step = next(iter(steps)) if len(steps) == 1 else None
        v = cv.resume_verdict(picks, acceptable, read=read,
                              bad=self._bad_sources(start, step),
                              node_of={r: r // self.cfg.nproc for r in world})
        rec.verdicts.append(v)
        rec.resumed.append({"start": start.index, "step": step, "acceptable": v.facts[
            "acceptable"], "source": next((e.get("source") for e in self._events(
                start, ev.RESTORE_DONE)), None), "read": read, "ok": v.ok})
        start.restored, start.checked = step, True
        self._resolve_broken(step)

    def _bad_sources(self, start: StartRecord, step: int | None) -> dict[int, set[str]]:
        """Per node, the sources whose copy of ``step`` was missing or damaged when the
        start launched: its tier 1, its own RAM, the replica its partner held for it."""
        if step is None:
            return {}
        out = {}
        for n in range(self.cfg.nnodes):
            bad = set()
            if step not in start.complete[n] or step in start.broken[n]:
                bad.add("tier1")
            if ("own", step) in start.ram_damaged[n]:
                bad.add("tier0")
            holder = cv.partner(n, self.cfg.nnodes)
            if ("replica", step) in start.ram_damaged[holder]:
                bad.add("tier0-peer")
            out[n] = bad
        return out

    def _resolve_broken(self, step: int | None) -> None:
        """After a restore, each copy the drill damaged that is still at its name: one a
        restore had to look at — a tier-1 copy newer than the restore point, a RAM copy at
        or above it (RAM is read first), any replica (each is verified at every restore) —
        is left broken (a violation); the rest were never read and stay tracked (the scrub
        finds them; the uploader never copies them: docs/drills.md). Gone ones are done."""
        for n, steps in self.broken.items():
            for s in sorted(steps):
                if not self._still_damaged(n, "tier1", s):
                    steps.discard(s)
                elif step is None or s > step:
                    self.left_broken.add((n, s))
                    steps.discard(s)
        for n, copies in self.ram_damaged.items():
            for where, s in sorted(copies):
                if not self._still_damaged(n, where, s):
                    copies.discard((where, s))
                elif where == "replica" or step is None or s >= step:
                    self.left_broken.add((f"{n} {_RAM_LABEL[where]}", s))
                    copies.discard((where, s))

    # -- checks at rest -------------------------------------------------------------------
    def _snapshot(self, rec: CycleRecord) -> None:
        """Nothing runs: every complete checkpoint — on tier 1, and with tier 0 in each
        node's RAM and the replica it holds — verifies in full, except the copies the drill
        damaged that no restore had to read: the scrub checks those too and reports what it
        finds, and tier 2's copy of such a step, if it holds one, must verify (the damaged
        bytes were never uploaded). Nothing retained on tier 1 went missing (a restore
        dropping a RAM copy excuses no tier-1 step)."""
        self._tick(force=True)
        now = {n: cf.step_dirs(r)[0] for n, r in enumerate(self.roots)}
        checks: list[cv.Check] = []
        damaged: list[cv.Check] = []
        for n, steps in now.items():
            for s in sorted(steps):
                r = check_tier1(self.roots[n], s)
                (damaged if s in self.broken[n] else checks).append((n, s, r.ok, r.error))
        own, held = self._ram_held()
        for n, ram in enumerate(self.rams):
            if ram is None:
                continue
            for where, root, steps in (("own", ram, own[n]), ("replica", ram / PEER_DIR,
                                                               held[n])):
                for s in sorted(steps):
                    r = check_tier1(root, s)
                    (damaged if (where, s) in self.ram_damaged[n] else checks).append(
                        (f"{n} {_RAM_LABEL[where]}", s, r.ok, r.error))
        rec.verdicts.append(cv.integrity_verdict(checks, self.left_broken, damaged=damaged,
                                                 tier2=self._tier2_checks()))
        if self.cfg.dedup:
            rec.verdicts.append(self._tier2_verdict())
        self.left_broken = set()
        excused = {n: self.excused[n] | {int(e["step"]) for e in t.events if e["event"] ==
                                         ev.CHECKPOINT_SKIPPED and isinstance(e.get("step"), int)
                                         and not str(e.get("reason", "")).startswith("tier 0")}
                   for n, t in enumerate(self.tails)}
        rec.verdicts.append(cv.retained_verdict(self.seen, now, excused=excused,
                                                keep_last=self.keep_last))

    def _tier2_checks(self) -> list[tuple[int, bool, str | None]]:
        """Tier 2's copy of each step whose tier-1 copy the drill damaged and no restore
        read, checked in full once it verified (a verified copy cannot change: its marker
        is create-only). Nothing while tier 2 is down."""
        held = (self._tier2_steps() or frozenset()) - set().union(*self._t2_broken().values())
        out = []
        for s in sorted({s for steps in self.broken.values() for s in steps} & held
                        - self.tier2_ok):
            with open_storage(self.url) as storage:
                r = check_tier2(storage, s, scratch=self.base)
            if r.ok:
                self.tier2_ok.add(s)
            out.append((s, r.ok, r.error))
        return out

    def _tier2_verdict(self) -> cv.Verdict:
        """``--dedup``: every complete tier-2 step checked in full (once it verified: a
        verified copy changes only when the drill damages it again), the steps whose object
        the drill damaged every time; and what is left for the next sweep."""
        root = self._t2_dir()
        checks: list[tuple[int, bool, str | None]] = []
        damaged = set().union(*self._t2_broken().values())
        with open_storage(f"file://{root}") as storage:
            for s in Tier2Catalog(storage).complete_steps():
                if s in self.t2_verified:
                    checks.append((s, True, None))
                    continue
                r = check_tier2(storage, s, scratch=self.base)
                if r.ok and s not in damaged:
                    self.t2_verified.add(s)
                checks.append((s, r.ok, r.error))
        orphans, leases = co.leftovers(root)
        return cv.tier2_verdict(checks, damaged, orphans=orphans, leases=leases)

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

