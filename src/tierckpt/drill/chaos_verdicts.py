"""The chaos drill's invariants: every verdict a cycle (or the end of the run) is judged by.

The fault catalogue and the seeded plan are :mod:`tierckpt.drill.chaos_plan`; their names
are re-exported here (``__all__``), where the drill reads them.

Functions of values only (steps, event records, loss rows, counts): no files, no
processes, so every verdict is tested with hand-written values and every one can fail.

*Nodes* are the simulated nodes ``0..nnodes-1``, each with its own tier-1 root. A node's
*complete* steps are the final-named directories holding a ``COMPLETE`` file; *broken*
steps are those the drill damaged there and no restore has dealt with yet. *Tier-2 steps*
are the complete checkpoints on tier 2, or None while tier 2 is down. With tier 0, a node's
*RAM* steps are those it can restore from node RAM: intact in its own tier-0 root, or in
the replica its partner (node n+1 mod N) holds for it (:func:`ram_restorable`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tierckpt.drill import verdicts as vd

# The catalogue and the plan live in chaos_plan; the drill reads them here (see __all__).
from tierckpt.drill.chaos_plan import (
    AT_REST,
    DAMAGE_VARIANTS,
    HEAL_KINDS,
    HEAL_OUTCOMES,
    KILL_MOMENTS,
    KINDS,
    LIVE,
    NOTICE_KILL_MOMENTS,
    NOTICE_KINDS,
    NOTICE_SIGNALS,
    OBJECT_KINDS,
    OBJECT_VARIANTS,
    RAM_VARIANTS,
    RESTART_KINDS,
    TIER0_KINDS,
    UPLOADER_MOMENTS,
    CyclePlan,
    Fault,
    draw_plan,
    steps_needed,
)

__all__ = [
    "AT_REST",
    "DAMAGE_VARIANTS",
    "HEAL_KINDS",
    "HEAL_OUTCOMES",
    "INVARIANTS",
    "KILL_MOMENTS",
    "KINDS",
    "LIVE",
    "NOTICE_KILL_MOMENTS",
    "NOTICE_KINDS",
    "NOTICE_SIGNALS",
    "OBJECT_KINDS",
    "OBJECT_VARIANTS",
    "RAM_VARIANTS",
    "RESTART_KINDS",
    "TIER0_KINDS",
    "UPLOADER_MOMENTS",
    "Check",
    "CyclePlan",
    "Fault",
    "Launch",
    "Verdict",
    "crash_loop_verdict",
    "disk_verdict",
    "draw_plan",
    "expected_restore",
    "final_verdict",
    "integrity_verdict",
    "losses_verdict",
    "partner",
    "ram_restorable",
    "resume_verdict",
    "retained_verdict",
    "steps_needed",
    "summarize",
    "tier1_bound",
    "tier2_verdict",
]

INVARIANTS = ("resume", "crash_loop", "losses", "tier1_bound", "integrity", "retained",
              "final", "lost_work", "heal", "tier2")
"""Every invariant a cycle (or the end of the run) can violate. ``lost_work``: after a
notice that was not followed by a kill, every rank stopped at one step at or after the
newest step logged when it was sent, saved it, exited 75, and the restart resumed there
(:func:`tierckpt.drill.preempt_verdicts.lost_work_verdict`). ``heal``: a ``heal_kill`` ended
as :data:`HEAL_OUTCOMES` says, and every rank then restored one step, committed, no older
than the newest step committed before it chose (:func:`tierckpt.drill.chaos_heal.heal_verdict`).
``tier2``: with the object faults (``--dedup``), :func:`tier2_verdict`."""


def tier1_bound(keep_last: int, upload_backlog: int | None) -> int | None:
    """Step directories (complete ones plus saves in progress) one tier-1 root may hold:
    ``keep_last`` + ``upload_backlog`` waiting for tier 2 + 1 being written + 1 pinned by
    the uploader. None when the backlog is unbounded."""
    return None if upload_backlog is None else keep_last + upload_backlog + 2


# --- verdicts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """One invariant's outcome: ``name`` (one of :data:`INVARIANTS`), ``ok``, a one-line
    ``detail`` and the facts it was decided on."""

    name: str
    ok: bool
    detail: str
    facts: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def partner(node: int, nodes: int) -> int:
    """The node holding ``node``'s tier-0 replica (the library's ring: n → n+1 mod N)."""
    return (node + 1) % nodes


def ram_restorable(own: Mapping[int, Collection[int]], replicas: Mapping[int, Collection[int]],
                   damaged: Mapping[int, Collection[tuple[str, int]]]) -> dict[int, set[int]]:
    """Per node, the steps it can restore from RAM: complete in its own tier-0 root
    (``own[n]``), or in the replica its partner holds for it (``replicas[partner]``: the
    complete steps in that node's ``peer/``), minus the copies the drill damaged
    (``damaged[n]``: ``("own", step)`` in n's root, ``("replica", step)`` in n's ``peer/``).
    Both are verified before use, so a damaged copy is no source."""
    nodes = len(own)
    out = {}
    for n in own:
        h = partner(n, nodes)
        mine = {s for s in own[n] if ("own", s) not in damaged.get(n, ())}
        held = {s for s in replicas.get(h, ()) if ("replica", s) not in damaged.get(h, ())}
        out[n] = mine | held
    return out


def _restorable(step: int, node: int, complete: Mapping[int, Collection[int]],
                broken: Mapping[int, Collection[int]], tier2: Collection[int],
                ram: Mapping[int, Collection[int]],
                tier2_broken: Mapping[int, Collection[int]]) -> bool:
    return (step in complete[node] and step not in broken.get(node, ())) \
        or (step in tier2 and step not in tier2_broken.get(node, ())) \
        or step in ram.get(node, ())


def expected_restore(complete: Mapping[int, Collection[int]],
                     broken: Mapping[int, Collection[int]],
                     tier2: Collection[int] | None,
                     ram: Mapping[int, Collection[int]] | None = None,
                     tier2_broken: Mapping[int, Collection[int]] | None = None
                     ) -> int | str | None:
    """What a restart must resume: the newest step every node can restore from some
    source — RAM (``ram``, see :func:`ram_restorable`; the library reads it first), intact
    on its own tier 1, or complete on tier 2 with every file the node needs intact there
    (``tier2_broken[node]``: the tier-2 steps whose content object of that node's files the
    drill damaged) — else None (a fresh start) when no node can restore anything, else
    ``"refuse"`` (some nodes could, others not: the library refuses to start training from
    scratch over them)."""
    t2, r, t2b = set(tier2 or ()), ram or {}, tier2_broken or {}
    steps = set(t2).union(*complete.values(), *r.values()) if complete else set(t2)
    for s in sorted(steps, reverse=True):
        if all(_restorable(s, n, complete, broken, t2, r, t2b) for n in complete):
            return s
    some = any(_restorable(s, n, complete, broken, t2, r, t2b) for n in complete for s in steps)
    return "refuse" if some else None


def resume_verdict(chosen: Mapping[int, int | None],
                   acceptable: Collection[int | str | None], *,
                   read: Mapping[int, Mapping[str, int]], bad: Mapping[int, Collection[str]],
                   node_of: Mapping[int, int]) -> Verdict:
    """Every rank chose the same step, one of ``acceptable`` (the expected restore points
    of the tier-2 states seen while the job restored), and never read it from a copy the
    drill damaged or removed: the ranks of a node whose copies of it on some sources were
    damaged or missing (``bad[node]``: ``tier1``, ``tier0``, ``tier0-peer``) read bytes from
    another source (``read[rank]``, its ``bytes_by_source``). Judged per node, not per
    rank: the node's ranks share its tier 1, so one rank fetches the node's files from tier
    2 into it and the others then read that fresh copy as tier 1. ``chosen`` maps rank →
    step (None: fresh start)."""
    facts = {"chosen": dict(chosen), "acceptable": sorted(acceptable, key=_rank_of)}
    if not chosen:
        return Verdict("resume", False, "no rank recorded checkpoint_chosen", facts)
    steps = set(chosen.values())
    if len(steps) != 1:
        return Verdict("resume", False, f"ranks chose different steps {dict(chosen)}", facts)
    (step,) = steps
    if step not in acceptable:
        return Verdict("resume", False, f"resumed from {step}, expected "
                       f"{' or '.join(map(str, facts['acceptable']))}", facts)
    for node in sorted(set(node_of[r] for r in chosen)):
        avoid = set(bad.get(node, ()))
        if step is None or not avoid:
            continue
        used = {src for rank in chosen if node_of[rank] == node
                for src, n in read.get(rank, {}).items() if n > 0}
        if not used - avoid:
            return Verdict("resume", False, f"node {node}'s ranks restored step {step} from "
                           f"{'+'.join(sorted(used)) or 'nowhere'} though node {node}'s copy "
                           f"there was damaged or missing ({'+'.join(sorted(avoid))})", facts)
    return Verdict("resume", True, f"resumed from {step}", facts)


def _rank_of(x: int | str | None) -> int:
    return x if isinstance(x, int) else -1 if x is None else -2


@dataclass(frozen=True)
class Launch:
    """One start of the job: ``restored`` (None: a fresh start), whether it ``committed`` a
    new step, and how it ended: ``"fault"`` (a fault the drill injected ended it: a kill, a
    full tier 1), ``"crash"`` (it exited on its own), ``"finished"`` or ``"running"``.
    ``excused``: why not committing was right (it started while tier 2 was down and a node
    could restore only from tier 2: refusing to start is the library's promise)."""

    index: int
    restored: int | None
    committed: bool
    end: str
    final_step: int
    excused: str | None = None


def crash_loop_verdict(launches: Sequence[Launch]) -> Verdict:
    """No crash loop: every start committed a new step (the drill injects the next fault
    only after that commit), except one that restored the final step and finished with
    nothing left to train, or one that was ``excused``; and no start ended on its own."""
    bad = []
    for ln in launches:
        if ln.excused or (ln.end == "finished" and ln.restored == ln.final_step):
            continue
        if ln.end == "crash":
            bad.append(f"start {ln.index} (restored {ln.restored}) exited on its own"
                       f"{'' if ln.committed else ' without committing a new step'}")
        elif not ln.committed:
            bad.append(f"start {ln.index} (restored {ln.restored}, {ln.end}) committed no "
                       "new step")
    facts = {"launches": [asdict(ln) for ln in launches]}
    if bad:
        return Verdict("crash_loop", False, "; ".join(bad), facts)
    return Verdict("crash_loop", True, f"{len(launches)} start(s), each committed", facts)


def losses_verdict(reference: Sequence[Mapping[str, Any]],
                   generations: Sequence[Sequence[Mapping[str, Any]]], *, rtol: float = 0.0,
                   complete: bool = False) -> Verdict:
    """Every loss every start logged equals the uninterrupted reference's at that step
    (bit for bit when ``rtol`` is 0: :func:`tierckpt.drill.verdicts.continuity`); with
    ``complete``, every reference step was logged by some start."""
    rows = [{**r, "attempt": g} for g, gen in enumerate(generations) for r in gen]
    v = vd.continuity(reference, rows, rtol=rtol)
    logged = {int(r["step"]) for r in rows if isinstance(r.get("step"), int)}
    missing = sorted(set(vd.losses_by_step(reference)) - logged) if complete else []
    facts = {"compared": v.compared, "mismatches": v.mismatches, "max_abs_diff":
             v.max_abs_diff, "missing": missing[:20], "mode": v.mode}
    if v.mismatches or v.compared == 0 or missing:
        what = (f"{len(v.mismatches)} loss(es) differ from the reference, first at step "
                f"{v.mismatches[0]['step']}" if v.mismatches else
                f"steps {missing[:5]} never logged" if missing else "no loss logged")
        return Verdict("losses", False, what, facts)
    return Verdict("losses", True, f"{v.compared} losses "
                   f"{'bit-identical' if rtol == 0 else 'within rtol'}", facts)


def disk_verdict(peaks: Mapping[int, int], bound: int | None) -> Verdict:
    """Each node's peak count of step directories (complete plus in progress) is within
    :func:`tier1_bound` (always true when the bound is None)."""
    facts = {"peaks": dict(peaks), "bound": bound}
    over = {n: p for n, p in peaks.items() if bound is not None and p > bound}
    if over:
        return Verdict("tier1_bound", False, f"tier 1 held {over} step directories, bound "
                       f"{bound}", facts)
    return Verdict("tier1_bound", True, f"peak {max(peaks.values(), default=0)} <= {bound}",
                   facts)


Check = tuple[int | str, int, bool, str | None]
"""``(where, step, ok, error)`` of one full check; ``where`` is a node, or a label such as
``"1 RAM"`` for a copy in node RAM."""


def integrity_verdict(checks: Iterable[Check],
                      left_broken: Iterable[tuple[int | str, int]] = (), *,
                      damaged: Iterable[Check] = (),
                      tier2: Iterable[tuple[int, bool, str | None]] = ()) -> Verdict:
    """Every surviving complete checkpoint verified in full; ``checks`` are ``(where, step,
    ok, error)``. ``left_broken``: damaged copies a restore left at their final name though
    it had to look at them (a later restart would meet them again). ``damaged``: the checks
    of copies the drill damaged that no restore had to read (older than the restore point,
    or the restore point read from another source): the scrub finding them is expected and
    reported, never a violation; they are never uploaded, so ``tier2`` — ``(step, ok,
    error)`` of tier 2's copy of each such step it holds — must verify."""
    checks, damaged, tier2 = list(checks), list(damaged), list(tier2)
    bad = [(n, s, e) for n, s, ok, e in checks if not ok]
    left = sorted(set(left_broken), key=str)
    uploaded = [(s, e) for s, ok, e in tier2 if not ok]
    found = [[n, s] for n, s, ok, _ in damaged if not ok]
    facts: dict[str, Any] = {
        "checked": len(checks), "failed": [list(b) for b in bad[:10]],
        "left_broken": [list(x) for x in left], "damaged_found": found,
        "damaged_unseen": [[n, s] for n, s, ok, _ in damaged if ok],
        "tier2_checked": [s for s, _, _ in tier2], "tier2_failed": [list(u) for u in uploaded]}
    if bad or left or uploaded:
        what = "; ".join([f"node {n} step {s}: {e}" for n, s, e in bad[:3]] +
                         [f"damaged step {s} left in place on node {n}" for n, s in left[:3]] +
                         [f"tier 2's step {s} does not verify though only a damaged copy of it "
                          f"was left to upload: {e}" for s, e in uploaded[:3]])
        return Verdict("integrity", False, what, facts)
    return Verdict("integrity", True, f"{len(checks)} complete checkpoints verify in full"
                   + (f"; the scrub found {len(found)} damaged copy(ies) no restore read, none "
                      "uploaded" if found else ""), facts)


def tier2_verdict(checks: Iterable[tuple[int, bool, str | None]], damaged: Collection[int],
                  *, orphans: int | None = None, leases: int | None = None) -> Verdict:
    """With the object faults (``--dedup``): every complete tier-2 step verifies in full
    (each object against the manifest's CRC32C and its SHA-256 name), except the steps
    whose content object the drill flipped or removed (``damaged``): their check must fail.
    ``checks`` are ``(step, ok, error)``. ``orphans`` and ``leases``: content objects no map
    or part names, and sweep leases, on tier 2 (facts: what a cut deletion left to sweep)."""
    checks = list(checks)
    bad = [(s, e) for s, ok, e in checks if not ok and s not in damaged]
    missed = [s for s, ok, _ in checks if ok and s in damaged]
    facts = {"checked": [s for s, _, _ in checks], "damaged": sorted(damaged), "failed":
             [list(b) for b in bad[:10]], "missed": missed, "orphans": orphans, "leases": leases}
    if bad or missed:
        return Verdict("tier2", False, "; ".join(
            [f"tier 2's step {s} does not verify: {e}" for s, e in bad[:3]] +
            [f"tier 2's step {s} verifies though the drill damaged an object it needs"
             for s in missed[:3]]), facts)
    found = sum(1 for s, ok, _ in checks if not ok)
    return Verdict("tier2", True, f"{len(checks) - found} tier-2 step(s) verify in full"
                   + (f"; {found} damaged one(s) fail as they must" if found else "")
                   + f"; {orphans} orphan object(s), {leases} lease(s) left", facts)


def retained_verdict(seen: Mapping[int, Collection[int]], now: Mapping[int, Collection[int]],
                     *, excused: Mapping[int, Collection[int]], keep_last: int) -> Verdict:
    """Nothing committed and still retained disappeared: a step once complete on a node
    (``seen``) and gone ``now`` was removed by the drill or set aside by a restore
    (``excused``: drill-made, ``checkpoint_skipped``), or retention was entitled to delete
    it (at least ``keep_last`` newer steps were committed on that node)."""
    lost = []
    for node, steps in seen.items():
        for s in sorted(set(steps) - set(now.get(node, ())) - set(excused.get(node, ()))):
            if sum(1 for t in steps if t > s) < keep_last:
                lost.append((node, s))
    facts = {"lost": [list(x) for x in lost], "keep_last": keep_last}
    if lost:
        return Verdict("retained", False, "committed step(s) vanished: " + ", ".join(
            f"{s} on node {n}" for n, s in lost[:5]), facts)
    return Verdict("retained", True, "nothing retained went missing", facts)


def final_verdict(*, final_step: int, tier2_steps: Collection[int] | None, check_ok: bool,
                  check_error: str | None, leftovers: Sequence[str], finished: bool) -> Verdict:
    """After the run: the job finished, its final checkpoint is complete on tier 2 and
    verifies in full (``check_ok``), and no process of the run is alive (``leftovers``:
    their command lines)."""
    facts = {"final_step": final_step, "tier2_steps": sorted(tier2_steps or ()),
             "tier2_check_ok": check_ok, "tier2_check_error": check_error,
             "leftovers": list(leftovers), "finished": finished}
    bad = []
    if not finished:
        bad.append("the job did not finish")
    if tier2_steps is None or final_step not in tier2_steps:
        bad.append(f"final step {final_step} is not on tier 2")
    elif not check_ok:
        bad.append(f"tier 2's step {final_step} does not verify: {check_error}")
    if leftovers:
        bad.append(f"{len(leftovers)} process(es) left behind: {leftovers[0][:120]}")
    if bad:
        return Verdict("final", False, "; ".join(bad), facts)
    return Verdict("final", True, f"step {final_step} on tier 2, verified; nothing left "
                   "running", facts)


def summarize(cycles: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per fault kind: the cycles that drew it and how many passed or violated an
    invariant; and the violations by invariant. ``cycles`` are the report's cycle records
    (``index``, ``kinds``, ``violations``: invariant names)."""
    by_kind: dict[str, dict[str, Any]] = {}
    by_invariant: dict[str, int] = {}
    for c in cycles:
        for kind in dict.fromkeys(c["kinds"]):
            k = by_kind.setdefault(kind, {"cycles": [], "passed": 0, "violated": 0})
            k["cycles"].append(c["index"])
            k["violated" if c["violations"] else "passed"] += 1
        for name in c["violations"]:
            by_invariant[name] = by_invariant.get(name, 0) + 1
    return {"by_kind": {k: by_kind[k] for k in KINDS if k in by_kind},
            "violations_by_invariant": by_invariant}
