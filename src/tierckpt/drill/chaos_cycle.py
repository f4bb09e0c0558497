"""One chaos cycle: wait for commits, inject the plan's faults, bring the job back.

:class:`CycleRunner` runs one :class:`tierckpt.drill.chaos_verdicts.CyclePlan` on the
running job (``_cycle``): it waits for the cycle's commits and for what an at-rest fault
needs, fires the live faults (``_live``: tier 2 renamed away, tier 1 filled to ENOSPC, the
uploader, a rank or a replica's holder SIGKILLed at its moment, a termination notice:
:mod:`tierckpt.drill.chaos_notice`, ranks killed for the job to heal:
:mod:`tierckpt.drill.chaos_heal`), takes the node down for
at-rest faults, and when the job ended waits until nothing of it is left, checks at rest,
applies the at-rest faults (``_at_rest``: damage, a partial commit, a wiped node, a wiped
or damaged node RAM, each skipped when it would leave a node nothing to restore from) and
restarts it; otherwise the job must commit on.
Each fault is recorded as a fact (fired or not, and why); the cycle's verdicts are closed
at its end. CheckpointError when the job cannot be brought back.
"""

from __future__ import annotations

import time
from typing import Any

from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_objects as co
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.chaos_config import (
    HOLD_FULL_S,
    MOMENT_S,
    PRECONDITION_S,
    UPLOAD_MOMENT_S,
    CycleRecord,
)
from tierckpt.drill.chaos_heal import HealRunner
from tierckpt.drill.inject import last_step
from tierckpt.format import layout
from tierckpt.runtime import events as ev

__all__ = ["CycleRunner"]

_FAST_POLL_S = 0.002


class CycleRunner(HealRunner):
    """The fault cycles of the chaos drill, each from its plan."""

    # -- one cycle ------------------------------------------------------------------------
    def _cycle(self, p: cv.CyclePlan) -> None:
        rec = self.rec = CycleRecord(p, p.index, prev=self.cur.index)
        self.cycles.append(rec)
        self._phase(rec, lambda: self._commits_after(len(self._commits(self.cur)) +
                                                     p.gap_saves), "commits before the fault")
        self._preconditions(rec, p)
        target = last_step(self.cur.losses) + p.offset_steps
        self._phase(rec, lambda: self._wait_running(
            lambda: last_step(self.cur.losses) >= target, self.cfg.commit_timeout_s),
            "the fault's step")
        self._phase(rec, lambda: "ok" if self._running() else "ended", "the fault")
        rec.t_fault = time.time()
        kill_follows = any(k in ("kill_rank", "kill_partner") for k in p.kinds)
        for f in p.faults:
            if f.kind in cv.LIVE:
                self._live(rec, f, p, kill_follows)
        if self.filler is not None and not rec.ended_by_fault and not self._running():
            # the full tier 1 failed a save (with tier 0: the copy to disk, surfacing at the
            # next save) and ended the job before the kill's moment came: the fault did it
            rec.ended_by_fault = True
            rec.notes.append("the full tier 1 ended the job before the kill")
        at_rest = [f for f in p.faults if f.kind in cv.AT_REST]
        if at_rest and not rec.ended_by_fault and self._running():  # the node goes down
            down = cv.Fault("kill_rank", at_rest[0].node, "between_saves")
            if self.cfg.heal:  # a rank's death would only heal: the node's launcher goes
                self._kill_job(rec, down)
            else:
                self._kill_rank(rec, down, implied=True)
        if rec.ended_by_fault or not self._running():
            self._down(rec, self.cur, "fault" if rec.ended_by_fault else "crash")
            self._snapshot(rec)
            for f in at_rest:
                self._at_rest(rec, f, p)
            self._recover(rec)
            self._judge_notices(rec)
        else:
            self._settle(rec)
        self._wait_outage_over(rec)
        self._close(rec)
        bad = [v.name for v in rec.verdicts if not v.ok]
        self.progress("chaos", "running", f"cycle {p.index}/{self.cfg.cycles} "
                      f"{'ok' if not bad else 'VIOLATED ' + ', '.join(dict.fromkeys(bad))}")

    def _preconditions(self, rec: CycleRecord, p: cv.CyclePlan) -> None:
        """An at-rest fault needs something to fall back on: a wiped node a tier-2 copy made
        by this start (not only an old one); a damaged or partial newest step an older one
        (or a tier-2 copy); a tier-2 object fault two readable tier-2 steps."""
        kinds = {f.kind for f in p.faults}
        need_t2 = "wipe_node" in kinds
        need_two = bool(kinds & {"damage", "partial_commit"})
        need_t2_two = bool(kinds & cv.OBJECT_KINDS)
        if not (need_t2 or need_two or need_t2_two):
            return
        floor = min(self._commits(self.cur), default=-1)

        def met() -> bool:
            remote = self._tier2_steps(through_outage=True) or frozenset()
            t2 = max(remote, default=-1) >= floor
            two = all(len(cf.step_dirs(r)[0]) >= 2 for r in self.roots)
            return (t2 or not need_t2) and (two or bool(remote) or not need_two) and \
                (len(remote) >= 2 or not need_t2_two)
        status = self._wait_running(met, PRECONDITION_S, poll_s=0.2)
        if status == "stalled":
            rec.notes.append("what the at-rest fault needs did not appear in time")
        elif status == "ended":
            self._unexpected(rec, status, "the at-rest fault's precondition")

    def _live(self, rec: CycleRecord, f: cv.Fault, p: cv.CyclePlan, kill_follows: bool) -> None:
        if not self._running():
            rec.faults.append(self._fact(f, fired=False, detail="the job was already down"))
            return
        if f.kind == "tier2_down":
            assert self.outage is not None
            self.outage.start()
            self.outage_t, self.outage_min = time.monotonic(), p.outage_s
            self.outage_marks = [len(t.events) for t in self.tails]
            self.outage_hold = p.restarts  # with a restart: the job restores while it lasts
            self.outage_fact = self._fact(f, fired=True, detail=f"{self.outage.root} renamed "
                                          f"away for >= {p.outage_s:.1f} s" +
                                          (" and until the restarted job restored"
                                           if p.restarts else ""))
            rec.faults.append(self.outage_fact)
        elif f.kind == "tier1_full":
            self._tier1_full(rec, f, kill_follows)
        elif f.kind == "kill_uploader":
            self._kill_uploader(rec, f)
        elif f.kind == "kill_partner":
            self._kill_partner(rec, f)
        elif f.kind in cv.NOTICE_KINDS:
            self._notice(rec, f)
        elif f.kind == "heal_kill":
            self._heal_kill(rec, f, p.pick)
        else:
            self._kill_rank(rec, f)

    def _tier1_full(self, rec: CycleRecord, f: cv.Fault, kill_follows: bool) -> None:
        """Fill the node's tier 1 and hold it full until the job ends (its next save fails),
        or — when a kill follows — until a save was attempted on the full disk."""
        path, n = cf.fill(self.roots[f.node])
        self.filler = path
        fact = self._fact(f, fired=True, detail=f"filled node{f.node}'s tmpfs with {n} bytes")
        rec.faults.append(fact)
        saves = 1 if kill_follows else 2
        until = last_step(self.cur.losses) + saves * self.save_every + 1
        status = self._wait_running(lambda: last_step(self.cur.losses) >= until, HOLD_FULL_S)
        if status == "ended":
            rec.ended_by_fault = True
        elif not kill_follows:  # the job trains on over a full disk: free it again
            fact["detail"] += "; the job ran on, freed"
            self._free_fill()

    def _kill_uploader(self, rec: CycleRecord, f: cv.Fault) -> None:
        tail, mark = self.tails[f.node], len(self.tails[f.node].events)
        if f.variant == "mid_upload":
            self._wait_running(lambda: any(e["event"] == ev.UPLOAD_STARTED
                                           for e in tail.events[mark:]), UPLOAD_MOMENT_S)
        pid: list[int | None] = [None]

        def found() -> bool:
            rank_pid = self._rank_pid(self.cur, f.node)
            pid[0] = cf.find_uploader(rank_pid) if rank_pid else None
            return pid[0] is not None
        self._wait_running(found, UPLOAD_MOMENT_S, poll_s=0.1)
        fired = pid[0] is not None and cf.kill(pid[0])
        rec.faults.append(self._fact(f, fired=fired, detail=f"SIGKILL uploader pid {pid[0]}"
                                     if fired else "no uploader was running"))

    def _kill_rank(self, rec: CycleRecord, f: cv.Fault, *, implied: bool = False) -> None:
        moment = {"in_save": ev.SAVE_STAGED, "commit_window": ev.SAVE_DURABLE}.get(
            f.variant or "")
        self._kill(rec, f, victim=f.node, moment=moment, implied=implied)

    def _kill_partner(self, rec: CycleRecord, f: cv.Fault) -> None:
        """SIGKILL the node holding ``f.node``'s replica as ``f.node``'s next save, just
        committed in its RAM, is being sent to it (on ``tier0_saved``)."""
        holder = cv.partner(f.node, self.cfg.nnodes)
        self._kill(rec, f, victim=holder, moment=ev.TIER0_SAVED, holder=holder)

    def _kill(self, rec: CycleRecord, f: cv.Fault, *, victim: int, moment: str | None,
              **extra: Any) -> None:
        """SIGKILL node ``victim``'s rank once ``f.node``'s rank logs ``moment`` (at once
        without one, or when it does not come within :data:`MOMENT_S`)."""
        rank, tail = f.node * self.cfg.nproc, self.tails[f.node]
        save_step = None
        if moment is not None:
            mark = len(tail.events)

            def seen() -> bool:
                return any(e["event"] == moment and e.get("rank") == rank
                           for e in tail.events[mark:])
            if self._wait_running(seen, MOMENT_S, poll_s=_FAST_POLL_S) == "ok":
                save_step = next(int(e["step"]) for e in tail.events[mark:]
                                 if e["event"] == moment and e.get("rank") == rank)
        pid = self._rank_pid(self.cur, victim)
        fired = pid is not None and self._running() and cf.kill(pid)
        victim_rank = victim * self.cfg.nproc
        if fired and pid is not None:
            rec.ended_by_fault = True
            self._log_kill(victim, pid, f"SIGKILLed pid {pid}")
        when = ("" if save_step is None else f", in the save of step {save_step}"
                if victim == f.node else f", as node {f.node}'s step {save_step} was "
                "replicated to it")
        fact = self._fact(f, fired=fired, detail=f"SIGKILL rank {victim_rank} pid {pid} after "
                          f"step {last_step(self.cur.losses)}{when}")
        fact.update(extra, save_step=save_step)
        rec.faults.append(fact)
        if fired and save_step is not None:
            self.kills.append((fact, save_step))

    def _at_rest(self, rec: CycleRecord, f: cv.Fault, p: cv.CyclePlan) -> None:
        """Apply one at-rest fault to the newest copy it hits, unless it would leave a node
        nothing to restore from (the library then rightly refuses to start; that is no
        drill)."""
        if f.kind in cv.OBJECT_KINDS:
            rec.faults.append(self._object_fault(f, p.pick))
            return
        n = f.node
        complete = {i: cf.step_dirs(r)[0] for i, r in enumerate(self.roots)}
        own, held = self._ram_held()
        where = "replica" if f.variant == "replica" else "own"
        pool = {"damage": complete[n], "partial_commit": complete[n],
                "damage_ram": held[n] if where == "replica" else own[n]}.get(f.kind)
        if pool is not None and not pool:
            rec.faults.append(self._fact(f, fired=False, detail="no checkpoint to damage"))
            return
        newest = max(pool) if pool else -1
        broken = {i: set(c) for i, c in self.broken.items()}
        damaged = {i: set(c) for i, c in self.ram_damaged.items()}
        if f.kind in ("wipe_node", "wipe_ram"):
            own[n], held[n] = set(), set()
            if f.kind == "wipe_node":
                complete[n] = set()
        elif f.kind == "partial_commit":
            complete[n].discard(newest)
        elif f.kind == "damage_ram":
            damaged[n].add((where, newest))
        else:
            broken[n].add(newest)
        if cv.expected_restore(complete, broken, self._tier2_steps(through_outage=True),
                               cv.ram_restorable(own, held, damaged),
                               self._t2_broken()) == "refuse":
            rec.faults.append(self._fact(f, fired=False, detail="skipped: it would leave a node "
                                         "nothing to restore from"))
            return
        rec.faults.append(self._fact(f, fired=True, detail=self._apply(f, newest, p.pick)))

    def _object_fault(self, f: cv.Fault, pick: float) -> dict[str, Any]:
        """A tier-2 object fault at rest: ``damage_object`` on a shard only the newest
        tier-2 step has — of a node that holds no other copy of that step when there is one
        (it must read tier 2's), else of the fault's node (only a shard's node reads it),
        ``cut_deletion`` of the oldest tier-2 step at a seeded deletion
        (:mod:`tierckpt.drill.chaos_objects`). Skipped when the step it breaks or deletes
        would leave a node nothing to restore from."""
        root = self._t2_dir()
        maps = co.tier2_maps(root)
        if len(maps) < 2:
            return self._fact(f, fired=False, detail=f"tier 2 holds {len(maps)} step(s); the "
                              "fault needs one to fall back on")
        step = max(maps) if f.kind == "damage_object" else min(maps)
        shards = [(n, k) for n, k in co.unique_objects(maps, step)
                  if layout.shard_rank(n) is not None]
        if f.kind == "damage_object" and not shards:
            return self._fact(f, fired=False, detail=f"no shard only step {step} has")
        complete = {i: cf.step_dirs(r)[0] for i, r in enumerate(self.roots)}
        own, held = self._ram_held()
        ram = cv.ram_restorable(own, held, self.ram_damaged)
        needy = {n for n in complete if step not in complete[n] and step not in ram[n]}
        mine = [nk for nk in shards if self._node_of(nk[0]) in needy] or \
            [nk for nk in shards if self._node_of(nk[0]) == f.node] or shards
        name, key = mine[int(pick * len(mine)) % len(mine)] \
            if f.kind == "damage_object" else ("", "")
        tier2 = set(self._tier2_steps(through_outage=True) or ())
        t2_broken = self._t2_broken({**self.t2_damaged, key: self._node_of(name)}) if name \
            else self._t2_broken()
        if f.kind == "cut_deletion":
            tier2.discard(step)
        if cv.expected_restore(complete, self.broken, tier2, ram, t2_broken) == "refuse":
            return self._fact(f, fired=False, detail="skipped: it would leave a node nothing to "
                              "restore from")
        if f.kind == "cut_deletion":  # the marker, the map, the manifest; a sweep of the rest
            points = 3 + len(co.unique_objects(maps, step)) + 1
            return self._fact(f, fired=True, detail=co.cut_deletion(
                root, step, 1 + int(pick * points)))
        assert f.variant is not None
        detail = co.damage_object(root, key, f.variant, pick)
        self.t2_damaged[key] = self._node_of(name)
        self.t2_verified -= set().union(*t2_broken.values())
        return self._fact(f, fired=True, detail=f"{detail} ({name} of step {step})")

    def _node_of(self, member: str) -> int:
        """The node whose rank wrote the shard ``member``."""
        rank = layout.shard_rank(member)
        assert rank is not None
        return rank // self.cfg.nproc

    def _apply(self, f: cv.Fault, newest: int, pick: float) -> str:
        """Inject an at-rest fault on ``newest`` and record it; returns what was done. A
        wiped node is a replaced one: with tier 0 its RAM goes too."""
        n, root, ram = f.node, self.roots[f.node], self.rams[f.node]
        if f.kind in ("wipe_node", "wipe_ram"):
            parts = [cf.wipe(root)] if f.kind == "wipe_node" else []
            if ram is not None:
                parts.append(cf.wipe_ram(ram))
                self.ram_damaged[n] = set()
            if f.kind == "wipe_node":
                self.excused[n] |= self.seen[n]
                self.broken[n] = set()
            return "; ".join(parts)
        if f.kind == "partial_commit":
            self.excused[n].add(newest)
            return cf.remove_step(root, newest)
        if f.kind == "damage_ram":
            where = "replica" if f.variant == "replica" else "own"
            detail = cf.flip_shard(self._copy_dir(n, where, newest).parent, newest, pick)
            self.ram_damaged[n].add((where, newest))
            self._mark_damaged(n, where, newest)
            return detail
        assert f.variant is not None
        detail = cf.damage(root, newest, f.variant, pick)
        self.broken[n].add(newest)
        self.excused[n].add(newest)
        self._mark_damaged(n, "tier1", newest)
        if cf.rebuilt_from_parts(root, newest):  # the scrub finds it; a restore may read it
            self.readable[n].add(newest)
            return detail + " (its parts rebuild the manifest: a restore may read the copy)"
        self.readable[n].discard(newest)
        return detail

    def _settle(self, rec: CycleRecord) -> None:
        """A cycle without a restart: the job must go on committing."""
        self._wait_outage_over(rec)
        self._phase(rec, lambda: self._commits_after(len(self._commits(self.cur)) + 1),
                    "a commit after the fault")

