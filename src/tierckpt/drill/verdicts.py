"""Pure drill logic: where to kill, and the verdicts on what the runs recorded.

Functions of values only (loss rows, event records, numbers): no files, no processes, so
they are tested with hand-written values. A *loss row* is one line of the training script's
losses file (rank 0): ``{"step", "loss", "loss_hex"?, "attempt"?, "world_size"?, "epoch"?,
"position"?}``; an *event* is a record of :mod:`tierckpt.runtime.events`.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.runtime import events as ev

__all__ = [
    "GPU_RTOL",
    "RESHARD_LOSS_RTOL",
    "ContinuityVerdict",
    "KillPlan",
    "SampleVerdict",
    "choose_kill",
    "continuity",
    "losses_by_step",
    "reshard_loss_ok",
    "restart_parts",
    "sample_continuity",
]

GPU_RTOL = 1e-2
"""Relative loss tolerance on GPU, where kernels are not bit-reproducible run to run."""

RESHARD_LOSS_RTOL = 0.1
"""After a reshard the global batch differs, so losses are not comparable bit for bit; the
first loss must still be within this relative distance of the reference's loss at that step
(a model that restarted from scratch or loaded the wrong weights is far outside it)."""

Row = Mapping[str, Any]
Event = Mapping[str, Any]


@dataclass(frozen=True)
class KillPlan:
    """SIGKILL global rank ``rank`` once step ``step`` has completed."""

    step: int
    rank: int


def choose_kill(seed: int, *, steps: int, save_steps: Iterable[int], world_size: int,
                tail: int = 2) -> KillPlan:
    """A seeded random (step, rank) to kill: after the first save (so there is a checkpoint
    to resume from), not a save step, and at least ``tail`` steps before the end (so the
    kill lands before the job finishes). ConfigError when no step qualifies."""
    saves = sorted(set(save_steps))
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if not saves:
        raise ConfigError("the reference run saved no checkpoint; the kill drill needs a save "
                          "before the kill (lower the training script's save interval)")
    candidates = [s for s in range(saves[0] + 1, steps - tail) if s not in saves]
    if not candidates:
        raise ConfigError(f"no step to kill at: steps={steps}, saves at {saves}; run more "
                          f"steps (--steps) or save more often")
    rng = random.Random(seed)
    return KillPlan(step=rng.choice(candidates), rank=rng.randrange(world_size))


def losses_by_step(rows: Iterable[Row]) -> dict[int, Row]:
    """The last row per step (a resumed run logs the steps after its checkpoint again)."""
    return {int(r["step"]): r for r in rows if isinstance(r.get("step"), int)}


@dataclass(frozen=True)
class ContinuityVerdict:
    """Per-step losses of a resumed run against an uninterrupted reference.

    ``mode`` is ``"exact"`` (bit patterns equal) or ``"rtol"`` (``|a-b| <= rtol·|b|``);
    ``compared`` counts rows checked; ``mismatches`` lists up to ten ``{step, loss,
    reference}``; ``missing`` the reference steps the run never logged after resuming.
    """

    ok: bool
    mode: str
    rtol: float
    compared: int
    resumed_rows: int
    max_abs_diff: float
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _same(a: Row, b: Row, rtol: float) -> bool:
    if rtol == 0.0:
        if "loss_hex" in a and "loss_hex" in b:
            return bool(a["loss_hex"] == b["loss_hex"])
        return float(a["loss"]) == float(b["loss"])
    return abs(float(a["loss"]) - float(b["loss"])) <= rtol * abs(float(b["loss"]))


def continuity(reference: Sequence[Row], run: Sequence[Row], *, rtol: float = 0.0,
               resumed_from: int | None = None) -> ContinuityVerdict:
    """Compare every row of ``run`` (all attempts) with the reference row of its step.

    Passes when every row matches, the run has rows after ``resumed_from`` (the restored
    step) from a later attempt, and every reference step after ``resumed_from`` appears.
    ``rtol == 0`` compares ``loss_hex`` (bit for bit) where both rows have it.
    """
    if rtol < 0 or not math.isfinite(rtol):
        raise ConfigError(f"rtol must be a finite number >= 0, got {rtol}")
    ref = losses_by_step(reference)
    mismatches: list[dict[str, Any]] = []
    compared, max_diff = 0, 0.0
    for r in run:
        want = ref.get(int(r["step"]))
        if want is None:
            continue
        compared += 1
        max_diff = max(max_diff, abs(float(r["loss"]) - float(want["loss"])))
        if not _same(r, want, rtol) and len(mismatches) < 10:
            mismatches.append({"step": int(r["step"]), "loss": float(r["loss"]),
                               "reference": float(want["loss"])})
    first_attempt = min((int(r.get("attempt", 0)) for r in run), default=0)
    resumed = [r for r in run if int(r.get("attempt", 0)) > first_attempt]
    after = {int(r["step"]) for r in resumed}
    start = -1 if resumed_from is None else resumed_from
    missing = sorted(s for s in ref if s > start and s not in after)
    ok = not mismatches and bool(resumed) and not missing and compared > 0
    return ContinuityVerdict(ok=ok, mode="exact" if rtol == 0 else "rtol", rtol=rtol,
                             compared=compared, resumed_rows=len(resumed),
                             max_abs_diff=max_diff, mismatches=mismatches,
                             missing=missing[:20])


def reshard_loss_ok(after: float | None, reference: float | None,
                    rtol: float = RESHARD_LOSS_RTOL) -> bool:
    """Whether the first loss after a reshard is finite and within ``rtol`` of the
    reference's loss at the same step (True when there is no reference to compare with)."""
    if after is None or not math.isfinite(after):
        return False
    if reference is None:
        return True
    return abs(after - reference) <= rtol * abs(reference)


@dataclass(frozen=True)
class SampleVerdict:
    """Whether the global sample position advanced by exactly one global batch per step.

    ``checked`` is False when the rows carry no ``position`` (the script does not report
    it); then ``ok`` is True and ``detail`` says so.
    """

    ok: bool
    checked: bool
    batch_per_rank: int | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_continuity(before: Sequence[Row], after: Sequence[Row],
                      restored_step: int) -> SampleVerdict:
    """Check ``ResumableSampler``'s promise across a resume, possibly at another world size.

    ``before``: rows of the run that wrote the checkpoint (steps up to ``restored_step``);
    ``after``: rows of the resumed run. The per-rank batch ``B`` is inferred from
    ``before`` (position step / world size). Every step after the restored one must advance
    the position by ``world_size · B`` in the same epoch, or start the next epoch at
    ``world_size · B`` — then the union of what the ranks read is a contiguous slice of the
    epoch's permutation: nothing repeated, nothing skipped (a tail shorter than one global
    batch is dropped at an epoch's end, as documented).
    """
    seq = [r for r in sorted(before, key=lambda r: int(r["step"]))
           if int(r["step"]) <= restored_step]
    seq = list(losses_by_step(seq).values())
    tail = sorted(losses_by_step(after).values(), key=lambda r: int(r["step"]))
    rows = seq + tail
    if not all("position" in r and "epoch" in r and "world_size" in r for r in rows):
        return SampleVerdict(True, False, None, "rows carry no epoch/position: not checked")
    if not seq or not tail:
        return SampleVerdict(False, True, None, "no rows before or after the resume")
    if seq[-1]["step"] != restored_step:
        return SampleVerdict(False, True, None, f"no row for restored step {restored_step}")
    first = seq[0]
    w0 = int(first["world_size"])
    if int(first["position"]) % w0:
        return SampleVerdict(False, True, None, f"step {first['step']}: position "
                             f"{first['position']} is not a multiple of world size {w0}")
    batch = int(first["position"]) // w0 // (int(first["step"]) + 1) \
        if int(first["epoch"]) == 0 else None
    if not batch:
        return SampleVerdict(False, True, None, "cannot infer the batch size from the run")
    for prev, cur in itertools.pairwise(rows):
        if int(cur["step"]) != int(prev["step"]) + 1:
            return SampleVerdict(False, True, batch,
                                 f"step {cur['step']} follows step {prev['step']}")
        glob = int(cur["world_size"]) * batch
        same = int(cur["epoch"]) == int(prev["epoch"])
        want = int(prev["position"]) + glob if same else glob
        if not same and int(cur["epoch"]) != int(prev["epoch"]) + 1:
            return SampleVerdict(False, True, batch, f"step {cur['step']}: epoch jumped "
                                 f"{prev['epoch']} -> {cur['epoch']}")
        if int(cur["position"]) != want:
            return SampleVerdict(False, True, batch, (
                f"step {cur['step']} (world size {cur['world_size']}): position "
                f"{cur['position']}, expected {want}; samples were "
                f"{'skipped' if int(cur['position']) > want else 'repeated'}"))
    return SampleVerdict(True, True, batch, f"{len(tail)} steps after step {restored_step} "
                         "read the next samples of the epoch, none repeated or skipped")


_MILESTONES = (
    ("respawn_s", "process_started_at"),
    ("startup_s", ev.PROCESS_START),
    ("pg_init_s", ev.PG_READY),
    ("setup_and_choose_s", ev.CHECKPOINT_CHOSEN),
    ("load_s", ev.STATE_LOADED),
    ("first_step_s", ev.FIRST_STEP),
)
"""R's parts: (name, the event that ends it). ``respawn_s``: kill → the new processes exist
(the launcher's detection, teardown and respawn); ``startup_s``: interpreter and imports up
to ``init_distributed``; ``pg_init_s``: process group; ``setup_and_choose_s``: model,
manager, discovery and verification up to the chosen checkpoint; ``load_s``: reading it into
the state; ``first_step_s``: the first training step after it."""


def restart_parts(events: Iterable[Event], failure_t: float) -> dict[str, Any] | None:
    """R and its parts for the first restart after a failure at ``failure_t``.

    Milestones of the new generation (events after ``failure_t``), each taken at the slowest
    rank: the new processes exist (``process_start.process_started_at``), ``process_start``,
    ``pg_ready``, ``checkpoint_chosen``, ``state_loaded``, ``first_step``. Parts (see
    ``_MILESTONES``) are the gaps between consecutive milestones; a missing milestone's part
    is None and the next part absorbs its time. ``R_s`` is failure → last ``first_step``.
    None when the generation never reached a first step.
    """
    after = [e for e in events if _t(e) is not None and _t(e) >= failure_t]  # type: ignore[operator]
    times: dict[str, float] = {}
    for name, kind in _MILESTONES:
        if kind == "process_started_at":
            vals = [float(e["process_started_at"]) for e in after
                    if e.get("event") == ev.PROCESS_START
                    and isinstance(e.get("process_started_at"), (int, float))]
        else:
            vals = [float(e["t"]) for e in after if e.get("event") == kind]
        if vals:
            times[name] = max(vals)
    if "first_step_s" not in times:
        return None
    parts: dict[str, float | None] = {}
    prev = failure_t
    for name, _ in _MILESTONES:
        if name in times:
            parts[name] = max(0.0, times[name] - prev)
            prev = max(prev, times[name])
        else:
            parts[name] = None
    restored = [e.get("step") for e in after if e.get("event") == ev.CHECKPOINT_CHOSEN]
    return {"R_s": times["first_step_s"] - failure_t, "parts": parts,
            "resumed_from_step": restored[0] if restored else None,
            "milestones_t": times}


def unfinished_saves(events: Iterable[Event], failure_t: float) -> list[int]:
    """Steps whose save had begun (``save_staged``) before ``failure_t`` but was not
    committed by then: the saves a failure interrupted, which a resume cannot use."""
    before = [e for e in events if (_t(e) or 0.0) < failure_t]
    staged = {int(e["step"]) for e in before if e.get("event") == ev.SAVE_STAGED}
    done = {int(e["step"]) for e in before
            if e.get("event") in (ev.SAVE_COMMITTED, ev.SAVE_FAILED) and "step" in e}
    return sorted(staged - done)


def _t(e: Event) -> float | None:
    t = e.get("t")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None
