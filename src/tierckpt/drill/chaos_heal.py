"""The chaos drill's heal faults (``--chaos N --heal``): inject them, judge them.

With ``--heal`` the job runs on one node under ``tierckpt run`` (the heal launcher, two
pre-warmed spares), so a killed rank is healed, not restarted. :class:`HealRunner` adds:

- ``heal_kill`` — SIGKILL of seeded ranks (the plan's ``pick`` seeds which), in one of the
  variants of :data:`~tierckpt.drill.chaos_verdicts.HEAL_OUTCOMES`: inside a step
  (``mid_step``), once the rank's next save is staged (``mid_save``), two ranks within a
  millisecond (``two_at_once``), a rank and then its replacement while it loads
  (``replacement``), a rank and then a survivor once that survivor's heal began
  (``mid_heal``). The drill waits for the fault's end — a heal done on every survivor, or
  the launcher's full restart — and a step after it. The job never goes down for it: the
  cycle goes on as after an uploader kill, and must commit again;
- the node going down for an at-rest fault (``_kill_job``): the launcher's whole process
  group (launcher, ranks, spares, uploaders) is SIGKILLed, as a lost node loses them; a
  single rank's death would only heal.

:func:`heal_verdict` is the ``heal`` invariant, a pure function of what was recorded: the
fault ended as it must, every rank then restored one step, that step was committed, and it
is no older than the newest step committed before the ranks chose (a heal goes back to the
newest complete checkpoint, as a restart does). The ``losses`` invariant proves the rest:
every loss after the heal equals the reference's bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Collection, Mapping
from typing import Any

from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.chaos_config import MOMENT_S, CycleRecord, StartRecord
from tierckpt.drill.chaos_notice import NoticeRunner
from tierckpt.drill.inject import last_step, read_jsonl
from tierckpt.runtime import events as ev

__all__ = ["HealRunner", "heal_catalogue", "heal_verdict"]

_FAST_POLL_S = 0.002
HEAL_MOMENT_S = 30.0  # longest wait for a replacement to start, or a survivor's heal to begin


_NOT_WITH_HEAL = {
    "kill_rank": "with --heal a killed rank heals: that is heal_kill",
    "tier1_full": "not drilled with --heal yet (a save failing on a full disk under the heal "
                  "launcher)"}


def heal_catalogue(heal: bool, catalogue: Mapping[str, Mapping[str, Any]]
                   ) -> dict[str, dict[str, Any]]:
    """The catalogue entries ``--heal`` decides: ``heal_kill`` injectable with it, and the
    kinds it leaves out (a plain kill, which would heal; a full tier 1, not drilled under
    the heal launcher yet) not injectable, each with why. The notices stay as ``--preempt``
    decides: the heal launcher passes SIGTERM on as torchrun does."""
    out: dict[str, dict[str, Any]] = {"heal_kill": {
        "injectable": heal, "how": "SIGKILL of seeded ranks under `tierckpt run`: mid_step, "
        "mid_save, two_at_once, replacement (then its replacement while it loads), mid_heal "
        "(then a survivor once its heal began)" if heal else "not asked for: give --heal"}}
    if heal:
        out.update({k: {"injectable": False, "how": why} for k, why in _NOT_WITH_HEAL.items()
                    if catalogue.get(k, {}).get("injectable", True)})
    return out


def heal_verdict(*, variant: str, outcome: str, chosen: Mapping[int, int | None], world: int,
                 newest_before: int | None, committed: Collection[int]) -> cv.Verdict:
    """``heal_kill(variant)`` ended in ``outcome`` (``"heal"``, ``"restart"``, or what
    stopped it: ``"none"``, ``"ended"``, ``"stalled"``) as
    :data:`~tierckpt.drill.chaos_verdicts.HEAL_OUTCOMES` says; each of the ``world`` ranks
    then chose a step (``chosen``: rank → its last ``checkpoint_chosen`` after the kill);
    all chose the same one; it is one of the ``committed`` steps (this start's commits and
    the step it restored); and it is no older than ``newest_before``, the newest of them
    committed before the ranks chose."""
    want = cv.HEAL_OUTCOMES[variant]
    facts = {"variant": variant, "outcome": outcome, "expected": want, "chosen": dict(chosen),
             "newest_before": newest_before, "committed": sorted(committed)}
    if outcome != want:
        return cv.Verdict("heal", False, f"heal_kill({variant}) ended in {outcome}, expected "
                          f"a {want}", facts)
    if len(chosen) != world:
        return cv.Verdict("heal", False, f"ranks {sorted(set(range(world)) - set(chosen))} "
                          f"restored nothing after heal_kill({variant})", facts)
    steps = set(chosen.values())
    if len(steps) != 1:
        return cv.Verdict("heal", False, f"ranks restored different steps {dict(chosen)}",
                          facts)
    (step,) = steps
    if step is None or step not in committed:
        return cv.Verdict("heal", False, f"restored step {step}, which was never committed "
                          f"(committed: {sorted(committed)[-5:]})", facts)
    if newest_before is not None and step < newest_before:
        return cv.Verdict("heal", False, f"restored step {step}, older than step "
                          f"{newest_before} committed before the ranks chose: work lost", facts)
    return cv.Verdict("heal", True, f"heal_kill({variant}): a {outcome}, every rank restored "
                      f"step {step}", facts)


class HealRunner(NoticeRunner):
    """Injects ``heal_kill`` and judges it; takes a heal job's node down for at-rest
    faults."""

    def _heal_kill(self, rec: CycleRecord, f: cv.Fault, pick: float) -> None:
        """Inject ``heal_kill(f.variant)`` and wait for its end (see the module
        docstring); the fault's fact gets the ranks, ``landed`` (the outcome), ``R_s`` (the
        kill → the first step logged after it), ``heal_s`` and ``restored_step``, and the
        cycle the ``heal`` verdict."""
        assert f.variant is not None
        n, tail, start = self.cfg.nproc, self.tails[0], self.cur
        victims = random.Random(pick).sample(range(n), 2 if f.variant == "two_at_once" else 1)
        if f.variant == "mid_save":
            mark = len(tail.events)
            self._wait_running(lambda: any(e["event"] == ev.SAVE_STAGED
                                           and e.get("rank") == victims[0]
                                           for e in tail.events[mark:]), MOMENT_S,
                               poll_s=_FAST_POLL_S)
        pids = [self._pid_of(start, r) for r in victims]
        if not self._running() or None in pids:
            rec.faults.append(self._fact(f, fired=False, detail=f"ranks {victims} had no pid "
                                         "or the job was down"))
            return
        mark, t_kill, step = len(tail.events), time.time(), last_step(start.losses)
        for pid in pids:
            assert pid is not None
            cf.kill(pid)
        detail = f"SIGKILL rank(s) {victims} (pids {pids}) after step {step}"
        if f.variant == "replacement":
            if self._wait_running(lambda: self._pid_of(start, victims[0], mark) is not None,
                                  HEAL_MOMENT_S, poll_s=_FAST_POLL_S) == "ok":
                pid = self._pid_of(start, victims[0], mark)
                assert pid is not None
                cf.kill(pid)
                detail += f", then its replacement pid {pid} while it loaded"
        elif f.variant == "mid_heal":
            survivor = next(r for r in range(n) if r not in victims)
            begun = self._wait_running(lambda: any(
                e["event"] == ev.HEAL_BEGIN and e.get("rank") == survivor
                for e in tail.events[mark:]) and self._pid_of(start, victims[0], mark)
                is not None, HEAL_MOMENT_S, poll_s=_FAST_POLL_S)
            pid = self._pid_of(start, survivor)
            if begun == "ok" and pid is not None:
                cf.kill(pid)
                victims.append(survivor)
                detail += f", then survivor rank {survivor} pid {pid} once its heal began"
        status = self._wait_running(lambda: self._heal_over(mark, victims) is not None,
                                    self.cfg.commit_timeout_s)
        outcome = self._heal_over(mark, victims) or status
        if outcome in ("heal", "restart"):
            status = self._wait_running(lambda: any(float(r.get("t", 0)) > t_kill for r in
                                                    read_jsonl(start.losses)),
                                        self.cfg.commit_timeout_s)
            if status != "ok":
                outcome = f"{outcome}, then {status}"
        fact = self._fact(f, fired=True, detail=detail)
        fact.update(ranks=victims, landed=outcome, **self._heal_facts(start, mark, t_kill))
        rec.faults.append(fact)
        rec.verdicts.append(self._judge_heal(start, f.variant, outcome.split(",")[0], mark))

    def _heal_over(self, mark: int, victims: list[int]) -> str | None:
        """``"restart"`` once every rank started again after ``mark``, ``"heal"`` once every
        survivor logged ``heal_done``, else None."""
        after = self.tails[0].events[mark:]
        restarted = {e.get("rank") for e in after if e["event"] == ev.PROCESS_START}
        if len(restarted) >= self.cfg.nproc:
            return "restart"
        healed = {e.get("rank") for e in after if e["event"] == ev.HEAL_DONE}
        return "heal" if len(healed) >= self.cfg.nproc - len(set(victims)) else None

    def _heal_facts(self, start: StartRecord, mark: int, t_kill: float) -> dict[str, Any]:
        after = self.tails[0].events[mark:]
        done = [e for e in after if e["event"] == ev.HEAL_DONE]
        rows = [float(r["t"]) for r in read_jsonl(start.losses) if float(r.get("t", 0)) > t_kill]
        chosen = self._chosen(mark)
        return {"R_s": round(min(rows) - t_kill, 3) if rows else None,
                "heal_s": round(max(float(e["seconds"]) for e in done), 3) if done else None,
                "restored_step": next(iter(set(chosen.values())), None)
                if len(set(chosen.values())) == 1 else None}

    def _chosen(self, mark: int) -> dict[int, int | None]:
        """Rank → the step of its last ``checkpoint_chosen`` after ``mark``."""
        return {int(e["rank"]): e.get("step") for e in self.tails[0].events[mark:]
                if e["event"] == ev.CHECKPOINT_CHOSEN and isinstance(e.get("rank"), int)}

    def _judge_heal(self, start: StartRecord, variant: str, outcome: str,
                    mark: int) -> cv.Verdict:
        after = self.tails[0].events[mark:]
        chosen = self._chosen(mark)
        t_chose = min((float(e["t"]) for e in after if e["event"] == ev.CHECKPOINT_CHOSEN),
                      default=float("inf"))
        commits = [(int(e["step"]), float(e["t"])) for e in self._events(start,
                   ev.SAVE_COMMITTED) if isinstance(e.get("step"), int)]
        committed = {s for s, _ in commits} | ({start.restored} if start.restored is not None
                                              else set())
        before = [s for s, t in commits if t < t_chose]
        if start.restored is not None:
            before.append(start.restored)
        return heal_verdict(variant=variant, outcome=outcome, chosen=chosen,
                            world=self.cfg.world_size, newest_before=max(before, default=None),
                            committed=committed)

    def _pid_of(self, start: StartRecord, rank: int, mark: int | None = None) -> int | None:
        """The pid of ``rank``'s newest process of this start (after event ``mark``, when
        given)."""
        events = self.tails[0].events[start.marks[0] if mark is None else mark:]
        pids = [int(e["pid"]) for e in events if e["event"] == ev.PROCESS_START
                and e.get("rank") == rank and isinstance(e.get("pid"), int)]
        return pids[-1] if pids else None

    def _kill_job(self, rec: CycleRecord, f: cv.Fault) -> None:
        """Take the heal job's node down for an at-rest fault: SIGKILL the launcher's
        process group (everything it started: ranks, spares, their uploaders)."""
        start = self.cur
        pid = start.job.procs[0].pid
        fired = self._running()
        if fired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            rec.ended_by_fault = True
            self._log_kill(0, pid, f"SIGKILLed the heal launcher's process group {pid}")
        fact = self._fact(f, fired=fired, detail=f"SIGKILL the launcher's process group {pid} "
                          f"after step {last_step(start.losses)} (the node went down)")
        fact.update(implied=True)
        rec.faults.append(fact)
