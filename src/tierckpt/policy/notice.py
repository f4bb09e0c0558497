"""What an emergency save can reach before a notice's deadline: the pure arithmetic shared
by the job (which tier to carry the save to, decided from this run's measured rates) and
``tierckpt plan --notice`` (is this grace period enough?). No I/O, no torch.

The emergency save is a chain, each link starting when the one before ends::

    notice ─ stop (≤ one step) ─ stage (C) ─ fastest tier ─ tier 1 ─ tier 2 (marker last)

The fastest tier is tier 0 (node RAM) when it is on, else tier 1. A later link is started
only if it ends by ``deadline - margin``; a link that would not is not started (and
nothing after it), so no tier ever holds a half-copied emergency save it could trust.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

TIERS = ("tier0", "tier1", "tier2")


@dataclasses.dataclass(frozen=True)
class Link:
    """One tier of the chain: ``start_s``/``end_s`` are seconds after the notice (inf: the
    rate is unknown); ``reached``: it ends by ``deadline - margin``; ``why`` when not."""

    tier: str
    start_s: float
    end_s: float
    reached: bool
    why: str = ""


@dataclasses.dataclass(frozen=True)
class NoticePlan:
    """The chain for one grace period; :attr:`durable` is the most durable tier reached
    (None: not even the first)."""

    grace_s: float
    margin_s: float
    links: tuple[Link, ...]

    @property
    def durable(self) -> str | None:
        reached = [link.tier for link in self.links if link.reached]
        return reached[-1] if reached else None

    @property
    def needed_s(self) -> float:
        """Grace (margin included) that reaches every tier of the chain (inf: a rate is
        unknown)."""
        return (self.links[-1].end_s if self.links else 0.0) + self.margin_s


def plan(nbytes: int, *, grace_s: float, tiers: Sequence[str],
         rates_bps: dict[str, float | None], stop_s: float = 0.0, stage_s: float = 0.0,
         margin_s: float = 0.0, elapsed_s: float = 0.0) -> NoticePlan:
    """The emergency-save chain for ``nbytes`` (per node: what each node writes in
    parallel) over ``tiers`` (in order, e.g. ``("tier0", "tier1", "tier2")``).

    ``rates_bps[tier]``: bytes/s of one node's copy into that tier (tier 0: its RAM write;
    tier 1: the disk write; tier 2: the upload, verification included); None or a missing
    key: unknown, so that link cannot be promised. ``stop_s``: notice → every rank stopped
    (one step); ``stage_s``: the blocking copy to host memory (C). ``elapsed_s``: seconds
    of the chain already spent (the job re-plans from where it is). A link that cannot end
    by ``grace_s - margin_s`` is not reached, and neither is any link after it.
    """
    for name in tiers:
        if name not in TIERS:
            raise ValueError(f"unknown tier {name!r}; tiers are {', '.join(TIERS)}")
    budget = grace_s - margin_s
    t = max(elapsed_s, stop_s + stage_s)
    links: list[Link] = []
    blocked = ""
    for tier in tiers:
        rate = rates_bps.get(tier)
        dur = math.inf if not rate or rate <= 0 else nbytes / rate
        end = t + dur
        if blocked:
            links.append(Link(tier, t, end, False, blocked))
        elif math.isinf(dur):
            blocked = f"the {tier} rate is not known yet"
            links.append(Link(tier, t, end, False, blocked))
        elif end > budget:
            blocked = (f"{tier} needs {dur:.1f} s and would end at {end:.1f} s, after "
                       f"{budget:.1f} s (grace {grace_s:.1f} s - margin {margin_s:.1f} s)")
            links.append(Link(tier, t, end, False, blocked))
        else:
            links.append(Link(tier, t, end, True))
        t = end
    return NoticePlan(grace_s=grace_s, margin_s=margin_s, links=tuple(links))
