"""The inputs of an :class:`~tierckpt.policy.interval.AutoInterval` decision, from this
root's event log (every incarnation of the run appends to it): C, W and R measured by
:mod:`tierckpt.runtime.measure`, the failures seen (restarted processes, less those whose
previous incarnation ended with a committed emergency save on a notice: a preemption is
announced, not a failure of the job's nodes) and the run's exposure (first event → now),
each with where it came from."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tierckpt.policy import costs
from tierckpt.policy.goodput import saved_preemption
from tierckpt.policy.interval import (
    DEFAULT_NODE_MTBF_S,
    DEFAULT_RESTART_S,
    AutoInterval,
    Inputs,
    median_recent,
)
from tierckpt.runtime import events as ev
from tierckpt.runtime import measure


def nodes_of(world_size: int) -> int:
    """Nodes of this job: world size ÷ ranks per node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // max(1, per_node))


def gather(policy: AutoInterval, events_path: Path, *, world_size: int,
           now: float | None = None) -> Inputs:
    """Read the event log and state every input with its source."""
    recs = ev.read_events(events_path) if events_path.exists() else []
    m = measure.from_events(recs)
    C = _recent_blocking(recs)
    now = time.time() if now is None else now
    first = min((float(r["t"]) for r in recs if isinstance(r.get("t"), int | float)),
                default=now)
    failures = _failures(recs)
    if m.R is not None:
        R, R_src = m.R.seconds, f"measured ({m.R.samples}: {m.R.source})"
    elif policy.restart is not None:
        R, R_src = float(policy.restart), "given"
    else:
        R, R_src = DEFAULT_RESTART_S, "default"
    mtbf, mtbf_src = (float(policy.node_mtbf), "given") if policy.node_mtbf is not None \
        else (DEFAULT_NODE_MTBF_S, "default")
    return Inputs(
        C=C[0] if C else 1.0, W=m.W.seconds if m.W else 0.0, R=R,
        node_mtbf=mtbf, nodes=nodes_of(world_size), failures=failures,
        exposure_s=max(0.0, now - first),
        C_source=(f"measured (median of the last {C[1]} saves"
                  + (f"; {C[2]} with the slower steps while writing)" if C[2] else ")"))
        if C else "default",
        W_source=f"measured ({m.W.samples})" if m.W else "default",
        R_source=R_src, mtbf_source=mtbf_src)


def _failures(recs: list[dict[str, Any]]) -> int:
    """Rank 0's restarted process starts, less each whose previous incarnation (rank 0's
    events since the start before it) logged a committed emergency save (``preempt_saved``
    with a tier reached, :func:`tierckpt.policy.goodput.saved_preemption`)."""
    rank0 = sorted((r for r in recs if int(r.get("rank", 0)) == 0
                    and isinstance(r.get("t"), int | float)), key=lambda r: float(r["t"]))
    failures, saved = 0, False
    for r in rank0:
        if r.get("event") == ev.PROCESS_START:
            if int(r.get("restart_count") or 0) > 0 and not saved:
                failures += 1
            saved = False  # a new incarnation: its own end decides the next start
        elif saved_preemption(r):
            saved = True
    return failures


def _recent_blocking(recs: list[dict[str, Any]], window: int = 9
                     ) -> tuple[float, int, int] | None:
    """Rolling C: per save, its whole cost (:func:`tierckpt.policy.costs.per_save`:
    the slowest rank's blocking time, raised to its measured cost with the slower steps
    while it wrote); the median of the last ``window`` saves (so a run whose saves got
    slower follows). Returns (C, saves, saves with a measured cost)."""
    per_step = costs.per_save(recs)
    recent = [per_step[s] for s in sorted(per_step)[-window:]]
    value = median_recent([c for c, _ in recent], window)
    return None if value is None else (value, len(recent), sum(m for _, m in recent))
