"""Pure logic of the preemption drills: where to send the notice, the times it took, and
the verdicts on what a preempted job recorded.

Functions of values only (event records, steps, seconds): no files, no processes. Both the
preemption drill (:mod:`tierckpt.drill.preempt`) and the chaos drill's notice faults
(:mod:`tierckpt.drill.chaos_notice`) judge with them, so both promise the same thing: after
a notice every rank stops at one agreed step, saves it, exits with
:data:`~tierckpt.preempt.config.EXIT_PREEMPTED`, and the restart resumes right after it —
the work lost is at most the step that was in progress when the notice came.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tierckpt.drill.chaos_verdicts import Verdict
from tierckpt.errors import ConfigError
from tierckpt.runtime import events as ev

__all__ = ["PREEMPT_VERDICTS", "TIERS", "NoticePlan", "choose_notice", "lost_work_verdict",
           "notice_timings", "saved_verdict", "stop_verdict"]

PREEMPT_VERDICTS = ("stop", "saved", "lost_work", "continuity", "verified")
"""The preemption drill's verdicts, in the order the report lists them."""
TIERS = ("tier0", "tier1", "tier2")

Event = Mapping[str, Any]


@dataclass(frozen=True)
class NoticePlan:
    """Send ``signal`` once step ``step`` is logged: to the launcher (every torchrun agent,
    which forwards it to its workers) when ``rank`` is None, else to that global rank's
    worker only (the others learn of it through the job's store)."""

    step: int
    rank: int | None
    signal: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_notice(seed: int, *, steps: int, world_size: int, rank: int | None = None,
                  tail: int = 4) -> NoticePlan:
    """A seeded random step after which the notice is sent: from step 1 (the loop's first
    ``should_stop`` has armed the handlers on every rank once step 1 is logged, since the
    ranks are in lockstep) to ``tail`` steps before the end (the agreed step may be up to two
    steps later, and the restart must have steps left to train). SIGTERM to the launcher, or
    SIGUSR1 to ``rank``. ConfigError when no step qualifies or the rank does not exist."""
    if rank is not None and not 0 <= rank < world_size:
        raise ConfigError(f"--preempt-rank must be a rank of the job (0..{world_size - 1}), "
                          f"got {rank}")
    candidates = range(1, steps - tail)
    if not candidates:
        raise ConfigError(f"no step to send the notice at: --steps {steps} leaves none "
                          f"between step 1 and {tail} steps before the end; give --steps "
                          f"{tail + 2} or more")
    step = random.Random(seed).choice(candidates)
    return NoticePlan(step=step, rank=rank, signal="SIGTERM" if rank is None else "SIGUSR1")


def _of(events: Iterable[Event], kind: str) -> list[Event]:
    return [e for e in events if e.get("event") == kind]


def stop_verdict(events: Iterable[Event], *, world_size: int) -> Verdict:
    """Every rank ``0..world_size-1`` logged ``preempt_stop``, all at one step. The step
    (``facts["step"]``) is None unless they agree."""
    stops = {int(e["rank"]): e.get("step") for e in _of(events, ev.PREEMPT_STOP)
             if isinstance(e.get("rank"), int)}
    steps = set(stops.values())
    facts: dict[str, Any] = {"by_rank": dict(sorted(stops.items())),
                             "step": next(iter(steps)) if len(steps) == 1 else None}
    missing = sorted(set(range(world_size)) - set(stops))
    if missing:
        return Verdict("stop", False, f"rank(s) {missing} logged no preempt_stop", facts)
    if len(steps) != 1:
        facts["step"] = None
        return Verdict("stop", False, f"the ranks stopped at different steps {stops}", facts)
    return Verdict("stop", True, f"all {world_size} ranks stopped after step "
                   f"{facts['step']}", facts)


def saved_verdict(events: Iterable[Event], *, step: int | None, world_size: int,
                  exit_code: int) -> Verdict:
    """Every rank logged ``preempt_saved`` for the agreed ``step`` with at least one tier
    reached, and ``preempt_exit`` with ``exit_code`` (preempted, checkpoint saved)."""
    events = list(events)
    saved = {int(e["rank"]): e for e in _of(events, ev.PREEMPT_SAVED)
             if isinstance(e.get("rank"), int)}
    exits = {int(e["rank"]): e.get("code") for e in _of(events, ev.PREEMPT_EXIT)
             if isinstance(e.get("rank"), int)}
    facts = {"reached": {r: list(e.get("reached") or []) for r, e in sorted(saved.items())},
             "abandoned": {r: dict(e.get("abandoned") or {}) for r, e in sorted(saved.items())
                           if e.get("abandoned")}, "exit_codes": dict(sorted(exits.items()))}
    bad = []
    for rank in range(world_size):
        e = saved.get(rank)
        if e is None:
            bad.append(f"rank {rank} logged no preempt_saved")
        elif e.get("step") != step or not e.get("reached"):
            bad.append(f"rank {rank} saved step {e.get('step')} to {e.get('reached')}, "
                       f"expected step {step} on some tier")
        if exits.get(rank) != exit_code:
            bad.append(f"rank {rank} exit code {exits.get(rank)}, expected {exit_code}")
    if bad:
        return Verdict("saved", False, "; ".join(bad[:4]), facts)
    return Verdict("saved", True, f"step {step} saved on every rank, each exited "
                   f"{exit_code}", facts)


def arrival_step(events: Iterable[Event]) -> int | None:
    """The step the first rank to learn of the notice had reached then (the
    ``preempt_notice`` received first; its ``step``), or None when no rank logged one."""
    notices = [e for e in _of(events, ev.PREEMPT_NOTICE)
               if isinstance(e.get("step"), int) and e["step"] >= 0
               and isinstance(e.get("received_unix"), (int, float))]
    first = min(notices, key=lambda e: float(e["received_unix"]), default=None)
    return None if first is None else int(first["step"])


def lost_work_verdict(*, stop_step: int | None, seen: int, logged_max: int,
                      resumed_from: int | None, first_resumed: int | None,
                      arrived: int | None = None) -> Verdict:
    """The work a notice cost is at most the step in progress when it came: the agreed
    step ``stop_step`` is at or after ``seen`` (the newest step logged when the notice was
    sent) and at most ``arrived + 2`` (``arrived``: the step the first rank to learn of it
    had reached, :func:`arrival_step`; lockstep ranks are one step apart, so the slowest
    finishes the step in progress and the fastest one more; None: not checked), no step
    after it was trained (``logged_max``, the newest step logged before the restart), the
    restart resumed from it (``resumed_from``), and its first step is the next one
    (``first_resumed``; None: not known, not checked)."""
    facts: dict[str, Any] = {"seen_at_notice": seen, "arrived_step": arrived,
                             "stop_step": stop_step,
                             "logged_max": logged_max, "resumed_from": resumed_from,
                             "first_resumed": first_resumed,
                             "steps_after_notice": None if stop_step is None
                             else stop_step - seen,
                             "lost_steps": None if resumed_from is None
                             else max(0, logged_max - resumed_from)}
    bad = []
    if stop_step is None:
        bad.append("the ranks agreed on no stop step")
    else:
        if stop_step < seen:
            bad.append(f"stopped at step {stop_step}, before step {seen} that was logged "
                       "when the notice was sent")
        if arrived is not None and stop_step > arrived + 2:
            bad.append(f"stopped at step {stop_step}, more than one step after step "
                       f"{arrived + 1} that was in progress when the notice came")
        if logged_max != stop_step:
            bad.append(f"step {logged_max} was trained though the ranks agreed on "
                       f"{stop_step}")
        if resumed_from != stop_step:
            bad.append(f"the restart resumed from {resumed_from}, not the saved step "
                       f"{stop_step}")
        elif first_resumed is not None and first_resumed != stop_step + 1:
            bad.append(f"the restart's first step was {first_resumed}, not {stop_step + 1}")
    if bad:
        return Verdict("lost_work", False, "; ".join(bad), facts)
    return Verdict("lost_work", True, f"nothing lost: step {seen} logged at the notice, "
                   f"step {stop_step} saved, resumed at {stop_step + 1}"
                   if stop_step is not None else "", facts)


def notice_timings(events: Iterable[Event], *, t_sent: float,
                   step: int | None) -> dict[str, Any]:
    """Seconds from sending the notice (``t_sent``, wall clock) to: every rank received it
    (``received_s``), every rank stopped at the agreed step (``stopped_s``), and the save
    of ``step`` durable on each tier the job reached (``durable_s``: ``tier0`` its
    ``tier0_saved``, ``tier1`` its ``save_committed`` on tier 1, ``tier2`` its
    ``upload_verified``; the slowest rank each), and every rank's ``preempt_saved``
    (``saved_s``). A tier is *reached* when some rank's ``preempt_saved`` names it and none
    abandoned it; ``abandoned`` maps each other tier to the first reason given.
    ``remaining_s``: the least grace left on any rank when it logged ``preempt_saved``."""
    events = list(events)

    def last(kind: str, pred: Any = None) -> float | None:
        ts = [float(e["t"]) for e in _of(events, kind)
              if (step is None or e.get("step") == step) and (pred is None or pred(e))]
        return max(ts) - t_sent if ts else None

    saved = _of(events, ev.PREEMPT_SAVED)
    abandoned: dict[str, str] = {}
    for e in saved:
        for tier, why in (e.get("abandoned") or {}).items():
            abandoned.setdefault(str(tier), str(why))
    named = {str(t) for e in saved for t in (e.get("reached") or [])}
    reached = [t for t in TIERS if t in named and t not in abandoned]
    received = [float(e["received_unix"]) for e in _of(events, ev.PREEMPT_NOTICE)
                if isinstance(e.get("received_unix"), (int, float))]
    probes = {"tier0": last(ev.TIER0_SAVED),
              "tier1": last(ev.SAVE_COMMITTED, lambda e: e.get("tier", "tier1") == "tier1"),
              "tier2": last(ev.UPLOAD_VERIFIED)}
    remaining = [float(e["remaining_s"]) for e in saved
                 if isinstance(e.get("remaining_s"), (int, float))]
    return {"received_s": max(received) - t_sent if received else None,
            "stopped_s": last(ev.PREEMPT_STOP), "saved_s": last(ev.PREEMPT_SAVED),
            "durable_s": {t: probes[t] for t in reached}, "reached": reached,
            "abandoned": abandoned, "remaining_s": min(remaining) if remaining else None}
