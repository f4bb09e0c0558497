"""The chaos drill's fault catalogue and its seeded plan: which faults each cycle injects,
on which node, at which moment. Pure: a function of the seed and the options, no files and
no processes, so a seed names one plan for good (new kinds go at the end of :data:`KINDS`).

:func:`draw_plan` draws the cycles; :mod:`tierckpt.drill.chaos_verdicts` judges them (and
re-exports these names, which the drill reads from there).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tierckpt.errors import ConfigError

KINDS = ("kill_rank", "kill_uploader", "tier2_down", "tier1_full", "damage", "partial_commit",
         "wipe_node", "wipe_ram", "damage_ram", "kill_partner", "notice_one_rank",
         "notice_then_kill", "notice_in_save", "heal_kill", "damage_object", "cut_deletion")
"""The fault catalogue (docs/drills.md, "Chaos drill"). New kinds go at the end: a plan
drawn without them stays the plan it was for a seed."""
TIER0_KINDS = frozenset({"wipe_ram", "damage_ram", "kill_partner"})
"""Kinds that need tier 0 (node RAM and a partner's replica); left out without it."""
NOTICE_KINDS = frozenset({"notice_one_rank", "notice_then_kill", "notice_in_save"})
"""Termination notices (docs/preemption.md); drawn only when asked for (``--preempt``)."""
HEAL_KINDS = frozenset({"heal_kill"})
"""Rank deaths the job heals (``--heal``: the job runs under ``tierckpt run``); drawn only
then, and then a plain ``kill_rank`` is not (a killed rank heals)."""
HEAL_OUTCOMES = {"mid_step": "heal", "mid_save": "heal", "two_at_once": "heal",
                 "replacement": "restart", "mid_heal": "restart"}
"""``heal_kill``'s variants and how each must end (:mod:`tierckpt.drill.heal`'s faults): a
rank killed inside a step, once its next save is staged, two ranks within a millisecond —
a heal; a rank and then its replacement while it loads, a rank and then a survivor once its
heal began — the launcher's full restart, which must resume as any restart does."""
OBJECT_KINDS = frozenset({"damage_object", "cut_deletion"})
"""Faults of tier 2's content objects (``--dedup``; a ``file://`` tier 2): a content object of
the newest tier-2 step flipped or removed, a deletion of the oldest tier-2 step SIGKILLed at
a seeded point; drawn only when asked for."""
LIVE = ("tier2_down", "kill_uploader", "tier1_full", "kill_partner", "kill_rank",
        "notice_one_rank", "notice_in_save", "notice_then_kill", "heal_kill")
"""Kinds injected while the job runs, in this order within a cycle (a full tier 1 ends the
job at its next save, so only a kill can follow it)."""
AT_REST = frozenset({"damage", "partial_commit", "wipe_node", "wipe_ram", "damage_ram",
                     *OBJECT_KINDS})
"""Kinds applied while no process of the job runs (then it restarts): to a node's root, its
RAM, or tier 2's objects."""
RESTART_KINDS = AT_REST | {"kill_rank", "tier1_full", "kill_partner"} | NOTICE_KINDS
"""Kinds after which the job restarts (a full tier 1 fails the next save, which ends it; a
notice ends it with exit status 75 after the emergency save)."""
_KILLS = frozenset({"kill_rank", "kill_partner"})  # one ends the job: never both in a cycle
_ENDERS = _KILLS | NOTICE_KINDS
"""Each ends the job: never two in a cycle. A notice never meets a full tier 1 either (its
emergency save would fail on it: no notice can keep its promise on a full disk), nor a
``heal_kill`` (a notice sent to one rank that is killed before it acts on it is lost, and
the healed job rightly trains on: --chaos 4 --heal --preempt --seed 3 drew that)."""
KILL_MOMENTS = ("between_saves", "in_save", "commit_window")
UPLOADER_MOMENTS = ("idle", "mid_upload")
DAMAGE_VARIANTS = ("truncate_shard", "flip_byte", "missing_file", "missing_marker")
RAM_VARIANTS = ("own", "replica")
"""What ``damage_ram`` flips a shard byte of: the node's own newest tier-0 copy, or the
newest replica it holds for its predecessor (``peer/``)."""
OBJECT_VARIANTS = ("flip", "missing")
"""What ``damage_object`` does to the content object: flip one byte, or delete it."""
NOTICE_SIGNALS = ("SIGUSR1", "SIGTERM")
"""The signal ``notice_one_rank`` sends to one node's rank."""
NOTICE_KILL_MOMENTS = ("at_once", "at_stop")
"""When ``notice_then_kill`` SIGKILLs the workers: right after the notice, or once a rank
logged ``preempt_stop`` (the emergency save is being taken)."""
_VARIANTS: dict[str, tuple[str, ...]] = {"kill_rank": KILL_MOMENTS,
                                         "kill_uploader": UPLOADER_MOMENTS,
                                         "damage": DAMAGE_VARIANTS,
                                         "damage_ram": RAM_VARIANTS,
                                         "notice_one_rank": NOTICE_SIGNALS,
                                         "notice_then_kill": NOTICE_KILL_MOMENTS,
                                         "heal_kill": tuple(HEAL_OUTCOMES),
                                         "damage_object": OBJECT_VARIANTS}


@dataclass(frozen=True)
class Fault:
    """One fault of a cycle: ``kind`` on ``node``; ``variant`` is the kill moment, the
    uploader moment or the damage (None for the other kinds)."""

    kind: str
    node: int
    variant: str | None = None

    @property
    def label(self) -> str:
        v = f"({self.variant})" if self.variant else ""
        return f"{self.kind}{v}@node{self.node}"


@dataclass(frozen=True)
class CyclePlan:
    """What cycle ``index`` (from 1) does: wait for ``gap_saves`` new commits, then
    ``offset_steps`` more steps, then inject ``faults``. ``outage_s``: the least time tier 2
    stays down; ``pick`` in [0, 1) chooses the file and byte a damage hits."""

    index: int
    faults: tuple[Fault, ...]
    gap_saves: int
    offset_steps: int
    outage_s: float
    pick: float

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(f.kind for f in self.faults)

    @property
    def restarts(self) -> bool:
        return any(k in RESTART_KINDS for k in self.kinds)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["faults"] = [f.label for f in self.faults]
        return d


def draw_plan(seed: int, cycles: int, *, nodes: int, kinds: Sequence[str] | None = None,
              compound_p: float = 0.5, save_every: int = 1) -> list[CyclePlan]:
    """``cycles`` seeded cycles, each one fault or (with probability ``compound_p``) two
    of different kinds (never two kills); two at-rest faults hit different nodes when there
    are two. ``kinds`` None: every kind but the notices, the heal and the object kinds
    (those are drawn only when asked for). ConfigError for an unknown kind, no kinds, or no node."""
    if kinds is None:
        kinds = tuple(k for k in KINDS if k not in NOTICE_KINDS | HEAL_KINDS | OBJECT_KINDS)
    if cycles < 1 or nodes < 1:
        raise ConfigError(f"the chaos drill needs cycles >= 1 and nodes >= 1, got {cycles}, "
                          f"{nodes}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ConfigError(f"unknown or no fault kinds {unknown or list(kinds)}; known: "
                          f"{list(KINDS)}")
    rng = random.Random(seed)
    plans = []
    for i in range(1, cycles + 1):
        first = rng.choice(list(kinds))
        chosen = [first]
        others = [k for k in kinds if k != first and _compatible(first, k)]
        if others and rng.random() < compound_p:
            chosen.append(rng.choice(others))
        faults: list[Fault] = []
        for kind in sorted(chosen, key=_order):
            node = rng.randrange(nodes)
            if kind in AT_REST and any(f.kind in AT_REST and f.node == node for f in faults):
                node = (node + 1) % nodes
            variant = rng.choice(_VARIANTS[kind]) if kind in _VARIANTS else None
            faults.append(Fault(kind, node, variant))
        plans.append(CyclePlan(index=i, faults=tuple(faults), gap_saves=rng.randint(1, 2),
                               offset_steps=rng.randrange(max(1, save_every)),
                               outage_s=round(rng.uniform(1.0, 3.0), 2), pick=rng.random()))
    return plans


def _compatible(a: str, b: str) -> bool:
    """Whether two kinds may share a cycle (see :data:`_ENDERS`)."""
    pair = {a, b}
    return not pair <= _ENDERS and not (pair & {"tier1_full", "heal_kill"}
                                        and pair & NOTICE_KINDS)


def _order(kind: str) -> int:
    return LIVE.index(kind) if kind in LIVE else len(LIVE)


def steps_needed(plans: Sequence[CyclePlan], *, save_every: int) -> int:
    """The fewest training steps the plan needs without any time-based hold: per cycle its
    commits before the fault, one interval of offset, a commit after the restart; plus two
    intervals at the end. Time-based holds (tier 2 down) need more at a fast step rate."""
    return sum((p.gap_saves + 2) * save_every for p in plans) + 2 * save_every
