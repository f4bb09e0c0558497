"""The chaos drill's termination notices (``--chaos N --preempt``): inject them, judge them.

:class:`NoticeRunner` adds the three notice kinds of
:data:`~tierckpt.drill.chaos_verdicts.NOTICE_KINDS` to the runner:

- ``notice_one_rank`` — SIGUSR1 or SIGTERM (the variant) to one node's rank only; the others
  must learn of it through the job's store;
- ``notice_in_save`` — SIGTERM to one node's launcher (torchrun forwards it to its workers)
  as that node's rank logs ``save_staged``: a background save is being written, so the
  emergency save must wait for it;
- ``notice_then_kill`` — SIGTERM to every launcher, then SIGKILL of every rank before the
  deadline: at once (``at_once``) or once a rank logged ``preempt_stop`` (``at_stop``: the
  emergency save is being taken). Nothing is promised but what a kill promises: the restart
  resumes from the newest complete checkpoint (``resume``), nothing committed is lost
  (``retained``, ``integrity``).

A notice ends the job the way the library documents: every rank saves and exits 75, and
torchrun then exits non-zero. That exit is the fault's intended end (the cycle's
``ended_by_fault``), never a crash. After the restart, each notice not followed by a kill
is judged by the ``lost_work`` invariant (:mod:`tierckpt.drill.preempt_verdicts`): every
rank stopped at one step, at or after the newest step logged when the notice was sent, saved
it and exited 75, nothing was trained past it, and the restart resumed there — unless an
at-rest fault of the same cycle hit that step, when the ``resume`` invariant alone judges the
restart's step.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill import preempt_verdicts as pv
from tierckpt.drill.chaos_config import MOMENT_S, CycleRecord, StartRecord
from tierckpt.drill.chaos_starts import StartRunner
from tierckpt.drill.inject import last_step, read_jsonl
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime import events as ev

__all__ = ["NoticeRunner"]

_FAST_POLL_S = 0.002


class NoticeRunner(StartRunner):
    """Injects the notice kinds and judges what they promise."""

    def _notice(self, rec: CycleRecord, f: cv.Fault) -> None:
        """Inject notice ``f`` into the running job (see the module docstring). A notice
        that was sent ends the job: the cycle treats its exit as the fault's."""
        start = self.cur
        if f.kind == "notice_in_save":
            rank, tail = f.node * self.cfg.nproc, self.tails[f.node]
            mark = len(tail.events)
            status = self._wait_running(lambda: any(
                e["event"] == ev.SAVE_STAGED and e.get("rank") == rank
                for e in tail.events[mark:]), MOMENT_S, poll_s=_FAST_POLL_S)
            in_save = next((int(e["step"]) for e in tail.events[mark:]
                            if e["event"] == ev.SAVE_STAGED and e.get("rank") == rank), None)
            fact = self._send(rec, f, start, [start.job.procs[f.node].pid], signal.SIGTERM,
                              f"node {f.node}'s launcher")
            fact["in_save"] = in_save if status == "ok" else None
        elif f.kind == "notice_one_rank":
            pid = self._rank_pid(start, f.node)
            sig = signal.Signals[f.variant or "SIGUSR1"]
            fact = self._send(rec, f, start, [pid] if pid else [], sig,
                              f"rank {f.node * self.cfg.nproc}")
        else:
            fact = self._send(rec, f, start, [p.pid for p in start.job.procs], signal.SIGTERM,
                              "every launcher")
            if fact["fired"]:
                self._kill_after_notice(rec, f, start, fact)
        rec.faults.append(fact)

    def _send(self, rec: CycleRecord, f: cv.Fault, start: StartRecord, pids: list[int],
              sig: signal.Signals, target: str) -> dict[str, Any]:
        seen = last_step(start.losses)
        t = time.time()
        fired = bool(pids) and self._running() and all(cf.send(pid, sig) for pid in pids)
        if fired:
            rec.ended_by_fault = True  # every rank saves and exits 75: the fault's own end
        fact = self._fact(f, fired=fired, detail=f"{sig.name} to {target} (pid "
                          f"{', '.join(map(str, pids)) or '?'}) after step {seen}"
                          if fired else "the job was already down or no pid was found")
        fact.update(seen=seen, t_sent=t, start=start.index)
        return fact

    def _kill_after_notice(self, rec: CycleRecord, f: cv.Fault, start: StartRecord,
                           fact: dict[str, Any]) -> None:
        """SIGKILL every rank of the job, at once or once a rank logged ``preempt_stop``
        (within :data:`MOMENT_S`); record each as ``failure_detected`` (``how: kill``)."""
        save_step = None
        if f.variant == "at_stop":
            status = self._wait_running(lambda: bool(self._events(start, ev.PREEMPT_STOP)),
                                        MOMENT_S, poll_s=_FAST_POLL_S)
            stops = self._events(start, ev.PREEMPT_STOP)
            save_step = int(stops[0]["step"]) if status == "ok" and stops else None
        killed = []
        for node, root in enumerate(self.roots):
            for pid in cf.children(start.job.procs[node].pid, str(root)):
                if cf.kill(pid):
                    killed.append(pid)
                    self._log_kill(node, pid, f"SIGKILLed pid {pid} after a notice")
        fact["detail"] += (f"; SIGKILL pid(s) {killed} {time.time() - fact['t_sent']:.2f} s "
                           "later" + (f", in the emergency save of step {save_step}"
                                      if save_step is not None else ""))
        fact.update(killed=killed, save_step=save_step)
        if save_step is not None:
            self.kills.append((fact, save_step))  # _down records where it landed

    def _start_events(self, start: StartRecord) -> list[dict[str, Any]]:
        """Every event of ``start`` alone (up to the next start's first), all nodes."""
        nxt = next((s for s in self.starts if s.index == start.index + 1), None)
        return [e for n, t in enumerate(self.tails)
                for e in t.events[start.marks[n]:nxt.marks[n] if nxt else None]]

    def _judge_notices(self, rec: CycleRecord) -> None:
        """After the restart: the ``lost_work`` verdict of each notice sent in this cycle
        and not followed by a kill; for ``notice_then_kill``, whether the emergency save
        was logged before the kill (a fact, not a promise)."""
        at_rest = any(f["fired"] and f["kind"] in cv.AT_REST for f in rec.faults)
        for fact in rec.faults:
            if fact["kind"] not in cv.NOTICE_KINDS or not fact["fired"]:
                continue
            start = next(s for s in self.starts if s.index == fact["start"])
            events = self._start_events(start)
            if fact["kind"] == "notice_then_kill":
                fact["emergency_saved"] = any(e["event"] == ev.PREEMPT_SAVED for e in events)
                continue
            rec.verdicts.append(self._lost_work(rec, fact, start, events, at_rest))

    def _lost_work(self, rec: CycleRecord, fact: dict[str, Any], start: StartRecord,
                   events: list[dict[str, Any]], at_rest: bool) -> cv.Verdict:
        stop = pv.stop_verdict(events, world_size=self.cfg.world_size)
        step = stop.facts["step"]
        saved = pv.saved_verdict(events, step=step, world_size=self.cfg.world_size,
                                 exit_code=EXIT_PREEMPTED)
        after = next((r for r in rec.resumed if r["start"] > start.index), None)
        nxt = next((s for s in self.starts if s.index > start.index), None)
        first = min((int(r["step"]) for r in read_jsonl(nxt.losses)
                     if isinstance(r.get("step"), int)), default=None) if nxt else None
        resumed = after["step"] if after else None
        if at_rest:  # the restart's step is the resume invariant's to judge
            resumed, first = step, None
        arrived = pv.arrival_step(events)
        lost = pv.lost_work_verdict(stop_step=step, seen=int(fact["seen"]),
                                    logged_max=last_step(start.losses), resumed_from=resumed,
                                    first_resumed=first, arrived=arrived)
        timings = pv.notice_timings(events, t_sent=float(fact["t_sent"]), step=step)
        fact.update(stop_step=step, arrived=arrived, stopped_s=timings["stopped_s"],
                    reached=timings["reached"], abandoned=timings["abandoned"])
        parts = [stop, saved, lost]
        facts: dict[str, Any] = {v.name: v.facts for v in parts}
        facts["timings"] = timings
        if at_rest:
            facts["resume_judged_by"] = "resume (an at-rest fault followed the notice)"
        bad = [v.detail for v in parts if not v.ok]
        if bad:
            return cv.Verdict("lost_work", False, f"{fact['label']}: " + "; ".join(bad), facts)
        return cv.Verdict("lost_work", True, f"{fact['label']}: every rank stopped after "
                          f"step {step} (step {fact['seen']} logged at the notice), saved to "
                          f"{'+'.join(timings['reached'])}, exited {EXIT_PREEMPTED}"
                          + ("" if at_rest else f", resumed at {step + 1}"), facts)
