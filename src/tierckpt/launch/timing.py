"""How long an emergency save takes, and the notice a scheduler must give for it: the lead
of Slurm's ``--signal``, torchrun's ``--shutdown-timeout`` and Kubernetes'
``terminationGracePeriodSeconds``. Pure but for :func:`read_root`.

The save time is measured, best source first:

1. this run's emergency saves (``preempt_saved``: notice → durable on the tier asked for),
   the slowest one, plus the margin;
2. else the chain's arithmetic (:func:`tierckpt.policy.notice.plan`) over the inputs
   :func:`tierckpt.runtime.rates.measure_chain` measured from the periodic saves: one step
   to stop, the blocking copy, then each tier up to the one asked for;
3. else unknown: the caller gives ``--lead``, or gets :data:`DEFAULT_LEAD_S`.

The notice asked for is ``SAFETY`` times the save time, at least :data:`MIN_LEAD_S`: a
save slower than the slowest measured one must still fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tierckpt.format import layout
from tierckpt.policy import notice
from tierckpt.runtime import events as ev
from tierckpt.runtime import rates

SAFETY = 1.5
"""The notice asked for, as a multiple of the measured emergency-save time."""
MIN_LEAD_S = 30
"""No lead shorter than this (Slurm may send ``--signal`` up to 60 s early anyway)."""
DEFAULT_LEAD_S = 120
"""The lead when nothing was measured and none was given."""
TEARDOWN_S = 10
"""Kubernetes: seconds after the workers' shutdown timeout for torchrun and the launcher's
verdict to finish before the kubelet's SIGKILL."""
DURABLE = ("tier1", "tier2")


@dataclasses.dataclass(frozen=True)
class SaveTime:
    """Seconds from a notice until the emergency save is durable on ``tier`` (margin
    included), and how that was obtained."""

    seconds: float
    tier: str
    source: str


@dataclasses.dataclass(frozen=True)
class Lead:
    """The notice to ask a scheduler for (whole seconds) and why. ``save`` is None when
    nothing was measured."""

    seconds: int
    save: SaveTime | None
    source: str

    @property
    def k8s_grace_s(self) -> int:
        """``terminationGracePeriodSeconds``: the lead plus torchrun's teardown."""
        return self.seconds + TEARDOWN_S


def read_root(tier1: str | Path) -> list[dict[str, Any]]:
    """The events of a tier-1 root (``events.jsonl``); [] when it has none yet."""
    path = Path(tier1) / layout.EVENTS
    return ev.read_events(path) if path.is_file() else []


def save_time(records: Iterable[Mapping[str, Any]], *, to: str = "tier1",
              margin_s: float = 2.0) -> SaveTime | None:
    """The emergency-save time to ``to`` (``tier1`` or ``tier2``) measured from event
    records (see the module docstring for the sources); None when they cannot tell."""
    if to not in DURABLE:
        raise ValueError(f"to={to!r}: an emergency save is made durable on one of {DURABLE}")
    recs = list(records)
    saved = [float(r["seconds"]) for r in recs if r.get("event") == ev.PREEMPT_SAVED
             and to in (r.get("reached") or ()) and _positive(r.get("seconds"))]
    if saved:
        return SaveTime(max(saved) + margin_s, to,
                        f"the slowest of {len(saved)} emergency saves to {to} "
                        f"(preempt_saved) + {margin_s:g} s margin")
    m = rates.measure_chain(recs)
    tiers = [t for t in ("tier0", "tier1", "tier2")
             if t in m.rates and notice.TIERS.index(t) <= notice.TIERS.index(to)]
    if m.nbytes is None or to not in tiers:
        return None
    p = notice.plan(int(m.nbytes.value), grace_s=math.inf, tiers=tiers,
                    rates_bps={t: m.rates[t].value for t in tiers},
                    stop_s=m.step_s.value if m.step_s else 0.0,
                    stage_s=m.stage_s.value if m.stage_s else 0.0, margin_s=margin_s)
    step = f"one step {m.step_s.value:.1f} s, " if m.step_s else "step time unknown, "
    return SaveTime(p.needed_s, to, f"the chain over {', '.join(tiers)} from the periodic "
                    f"saves ({step}{int(m.nbytes.value)} bytes, the slowest rates; "
                    f"+ {margin_s:g} s margin)")


def lead(save: SaveTime | None, *, given_s: float | None = None) -> Lead:
    """The notice to ask for: ``given_s`` when given, else :data:`SAFETY` × ``save``
    (at least :data:`MIN_LEAD_S`), else :data:`DEFAULT_LEAD_S`."""
    if given_s is not None:
        return Lead(math.ceil(given_s), save, "given (--lead)")
    if save is None:
        return Lead(DEFAULT_LEAD_S, None, "default: no emergency-save time measured yet "
                    "(run once with --tier1 set, or pass --lead)")
    secs = max(MIN_LEAD_S, math.ceil(save.seconds * SAFETY))
    return Lead(secs, save, f"{SAFETY:g} x {save.seconds:.1f} s ({save.source}), at least "
                f"{MIN_LEAD_S} s")


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0
