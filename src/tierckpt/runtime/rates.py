"""What an emergency save's chain is made of, measured from a run's events: the bytes a
save writes, each tier's copy rate, the blocking copy (C) and one step's time. Read by
``tierckpt plan --notice``; the arithmetic is :func:`tierckpt.policy.notice.plan`.
Torch-free.

The basis is *this log's ranks*: a tier-1 root's ``events.jsonl`` holds the events of the
ranks that write to that root (one node with node-local disks, every rank on a shared file
system). The bytes and the rates are both measured over those ranks, so bytes ÷ rate is the
time the copy took them, whichever layout the job had.

Each value is the *slowest* of the newest :data:`RECENT` saves (a deadline is met or not by
the slow saves, not the median one), except the step time (the median: a steady value):

- **bytes** — per step, the sum over ranks of ``save_durable.bytes`` (else the
  ``save_committed.bytes`` of the whole job); the largest.
- **tier 0** — per step, those ranks' ``tier0_saved`` bytes ÷ the slowest rank's seconds.
- **tier 1** — per step, the bytes ÷ ``save_committed.write_seconds`` (the slowest rank),
  less the step's ``tier0_saved`` and ``tier0_replicated`` seconds when tier 0 is on (then
  the write is RAM, replica, copy to tier 1). Flushes at close (no write time) are skipped.
- **tier 2** — ``upload_verified`` bytes ÷ seconds (verification included).
- **stage** — per step, the slowest rank's ``save_staged.seconds``.
- **step** — the newest ``interval_decided.step_s``, else the median of ``progress`` marks'
  seconds per step (per process).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from tierckpt.runtime import events as ev

RECENT = 10
"""Saves (or uploads) the slowest value is taken over, newest first."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One measured value (bytes, bytes/s or seconds) and how it was obtained."""

    value: float
    source: str
    samples: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainMeasurements:
    """Whatever the log measured; None where it had nothing. ``rates`` maps ``tier0``,
    ``tier1``, ``tier2`` to bytes/s."""

    nbytes: Sample | None = None
    rates: dict[str, Sample] = dataclasses.field(default_factory=dict)
    stage_s: Sample | None = None
    step_s: Sample | None = None


def _num(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x)


def _per_step(recs: list[Mapping[str, Any]], kind: str, field: str,
              tier: str | None = None) -> dict[int, dict[Any, float]]:
    """step → {rank: value} of ``kind``'s ``field`` (the newest record per rank)."""
    out: dict[int, dict[Any, float]] = collections.defaultdict(dict)
    for r in recs:
        if r.get("event") != kind or not isinstance(r.get("step"), int):
            continue
        if tier is not None and r.get("tier", "tier1") != tier:
            continue
        v = _num(r.get(field))
        if v is not None:
            out[int(r["step"])][r.get("rank")] = v
    return out


def _slowest(values: list[float], what: str, *, low: bool) -> Sample | None:
    """The slowest of the newest RECENT ``values`` (in time order): the lowest rate or the
    highest bytes/seconds."""
    recent = values[-RECENT:]
    if not recent:
        return None
    pick = min(recent) if low else max(recent)
    kind = "slowest" if low else "largest"
    return Sample(value=pick, samples=len(recent),
                  source=f"{kind} of the last {len(recent)} {what}")


def measure_chain(records: Iterable[Mapping[str, Any]]) -> ChainMeasurements:
    """Measure the chain's inputs from event records (as ``EventLog.emit`` writes them)."""
    recs = sorted((r for r in records if _num(r.get("t")) is not None),
                  key=lambda r: float(r["t"]))
    durable = _per_step(recs, ev.SAVE_DURABLE, "bytes")
    committed_bytes = _per_step(recs, ev.SAVE_COMMITTED, "bytes")
    step_bytes = {s: float(sum(v.values())) for s, v in durable.items()}
    for s, v in committed_bytes.items():
        step_bytes.setdefault(s, max(v.values()))
    nbytes = _slowest([step_bytes[s] for s in sorted(step_bytes)],
                      "saves' bytes (save_durable summed over this log's ranks)", low=False)

    rates: dict[str, Sample] = {}
    t0_s = _per_step(recs, ev.TIER0_SAVED, "seconds")
    t0_b = _per_step(recs, ev.TIER0_SAVED, "bytes")
    t0 = [sum(t0_b[s].values()) / max(t0_s[s].values()) for s in sorted(t0_s)
          if s in t0_b and max(t0_s[s].values()) > 0]
    if (r0 := _slowest(t0, "tier0_saved (bytes ÷ the slowest rank)", low=True)) is not None:
        rates["tier0"] = r0

    replicated = _per_step(recs, ev.TIER0_REPLICATED, "seconds")
    writes = _per_step(recs, ev.SAVE_COMMITTED, "write_seconds", tier="tier1")
    t1: list[float] = []
    for s in sorted(writes):
        secs = max(writes[s].values())
        secs -= max(t0_s.get(s, {}).values(), default=0.0)
        secs -= max(replicated.get(s, {}).values(), default=0.0)
        if secs > 0 and step_bytes.get(s):
            t1.append(step_bytes[s] / secs)
    if (r1 := _slowest(t1, "tier-1 writes (save_committed.write_seconds"
                           + (", less tier 0's)" if t0 else ")"), low=True)) is not None:
        rates["tier1"] = r1

    t2 = [b / sec for r in recs if r.get("event") == ev.UPLOAD_VERIFIED
          and (b := _num(r.get("bytes"))) and (sec := _num(r.get("seconds"))) and sec > 0]
    if (r2 := _slowest(t2, "uploads (upload_verified)", low=True)) is not None:
        rates["tier2"] = r2

    staged = _per_step(recs, ev.SAVE_STAGED, "seconds")
    stage = _slowest([max(staged[s].values()) for s in sorted(staged)],
                     "save_staged (the slowest rank per step)", low=False)
    return ChainMeasurements(nbytes=nbytes, rates=rates, stage_s=stage,
                             step_s=_step_seconds(recs))


def _step_seconds(recs: list[Mapping[str, Any]]) -> Sample | None:
    decided = [v for r in recs if r.get("event") == ev.INTERVAL_DECIDED
               and (v := _num(r.get("step_s"))) is not None and v > 0]
    if decided:
        return Sample(value=decided[-1], samples=1,
                      source="the newest interval_decided step_s")
    last: dict[Any, tuple[float, int]] = {}
    per_step: list[float] = []
    for r in recs:
        if r.get("event") != ev.PROGRESS or not isinstance(r.get("step"), int):
            continue
        t, step, pid = float(r["t"]), int(r["step"]), r.get("pid")
        if pid in last and step > last[pid][1]:
            per_step.append((t - last[pid][0]) / (step - last[pid][1]))
        last[pid] = (t, step)
    if not per_step:
        return None
    return Sample(value=statistics.median(per_step), samples=len(per_step),
                  source=f"median of {len(per_step)} progress intervals (seconds per step)")
