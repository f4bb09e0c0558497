"""Measured planning inputs (C, W, R) from an event log or a drill report.

This is the only planning module that reads files; the arithmetic stays in
:mod:`tierckpt.policy.plan`.
Each measured value comes with a one-line ``source`` saying how it was obtained, so the CLI
can say which inputs were measured and which were given.

From an event log (``tierckpt.runtime.events``; several ranks may write to one file):

- **C** — per step, the largest ``save_staged.seconds`` over ranks (the slowest rank gates
  the step), raised to the largest ``save_cost.seconds`` where the loop's step marks
  measured one (C plus the slower steps while the save wrote:
  :mod:`tierckpt.runtime.save_cost`), then the median over steps.
- **W** — median ``save_committed.write_seconds``.
- **R** — preferred: for each failure (``failure_detected`` events, those before the next
  ``first_step`` counted as one failure), the time from the earliest detection to the last
  rank's ``first_step`` after it (before the next detection or the next generation's
  ``process_start``); median over failures. It excludes the time before the
  failure was detected. Else: median ``first_step.seconds_since_process_start`` of restarted
  processes (``process_start.restart_count`` > 0, same pid) — it misses detection and
  rescheduling. Else: median ``restore_done.seconds`` — only the load itself, a lower bound.

From a drill report: the top-level ``"measured": {"C_s", "W_s", "R_s"}`` object; missing
or null keys are simply not measured.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.policy import costs
from tierckpt.runtime import events as ev

__all__ = ["Measured", "Measurements", "from_drill_report", "from_event_log", "from_events"]


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One measured value in seconds and how it was obtained."""

    seconds: float
    source: str
    samples: int


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Whatever could be measured; ``None`` where the log or report had nothing."""

    C: Measured | None = None
    W: Measured | None = None
    R: Measured | None = None


def from_event_log(path: str | os.PathLike[str]) -> Measurements:
    """Read ``path`` (JSONL events) and measure C, W and R; ConfigError if it cannot be read."""
    try:
        records = ev.read_events(path)
    except OSError as e:
        raise ConfigError(f"--from-events: cannot read {os.fspath(path)!r}: {e}") from None
    return from_events(records)


def from_events(records: Iterable[Mapping[str, Any]]) -> Measurements:
    """Measure C, W and R from event records (dicts as written by ``EventLog.emit``)."""
    recs = sorted((r for r in records if _num(r.get("t")) is not None),
                  key=lambda r: float(r["t"]))
    return Measurements(C=_blocking(recs), W=_write(recs), R=_restart(recs))


def from_drill_report(path: str | os.PathLike[str]) -> Measurements:
    """Read ``measured.{C_s,W_s,R_s}`` from a drill report JSON file."""
    name = "--from-drill"
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{name}: cannot read {os.fspath(path)!r}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"{name}: {os.fspath(path)!r} is not JSON: {e}") from None
    measured = doc.get("measured") if isinstance(doc, dict) else None
    if not isinstance(measured, dict):
        raise ConfigError(f"{name}: {os.fspath(path)!r} has no top-level \"measured\" object")
    out: dict[str, Measured | None] = {}
    for key, attr in (("C_s", "C"), ("W_s", "W"), ("R_s", "R")):
        raw = measured.get(key)
        if raw is None:
            out[attr] = None
            continue
        value = _num(raw)
        if value is None or value < 0:
            raise ConfigError(f"{name}: measured.{key} must be a non-negative number, got {raw!r}")
        out[attr] = Measured(seconds=value, source=f"drill report measured.{key}", samples=1)
    return Measurements(**out)


def _blocking(recs: list[Mapping[str, Any]]) -> Measured | None:
    per_step = costs.per_save(recs)
    unstepped = [s for r in recs if r.get("event") == ev.SAVE_STAGED
                 and r.get("step") is None and (s := _num(r.get("seconds"))) is not None]
    values = [c for c, _ in per_step.values()] + unstepped
    if not values:
        return None
    measured = sum(m for _, m in per_step.values())
    with_cost = f"; {measured} with the slower steps while writing" if measured else ""
    return Measured(seconds=statistics.median(values), samples=len(values),
                    source=f"median of {len(values)} save_staged (slowest rank per step"
                           f"{with_cost})")


def _write(recs: list[Mapping[str, Any]]) -> Measured | None:
    values = [v for r in recs if r.get("event") == ev.SAVE_COMMITTED
              and (v := _num(r.get("write_seconds"))) is not None]
    if not values:
        return None
    return Measured(seconds=statistics.median(values), samples=len(values),
                    source=f"median write_seconds of {len(values)} save_committed")


def _restart(recs: list[Mapping[str, Any]]) -> Measured | None:
    pairs = _detect_to_first_step(recs)
    if pairs:
        return Measured(seconds=statistics.median(pairs), samples=len(pairs),
                        source=f"median of {len(pairs)} failure_detected → first_step")
    restarted = {r.get("pid") for r in recs if r.get("event") == ev.PROCESS_START
                 and (_num(r.get("restart_count")) or 0) > 0}
    since = [v for r in recs if r.get("event") == ev.FIRST_STEP and r.get("pid") in restarted
             and (v := _num(r.get("seconds_since_process_start"))) is not None]
    if since:
        return Measured(seconds=statistics.median(since), samples=len(since),
                        source=f"median of {len(since)} process_start → first_step of "
                               "restarted processes (excludes detection and rescheduling)")
    loads = [v for r in recs if r.get("event") == ev.RESTORE_DONE
             and (v := _num(r.get("seconds"))) is not None]
    if loads:
        return Measured(seconds=statistics.median(loads), samples=len(loads),
                        source=f"median of {len(loads)} restore_done seconds "
                               "(load only: a lower bound on R)")
    return None


def _detect_to_first_step(recs: list[Mapping[str, Any]]) -> list[float]:
    """One duration per failure: earliest detection → the last first_step before the next
    detection or the next generation's process_start (events sorted by time)."""
    out: list[float] = []
    detected: float | None = None
    last_step: float | None = None
    for r in recs:
        kind, t = r.get("event"), float(r["t"])
        if kind == ev.FAILURE_DETECTED:
            if detected is not None and last_step is not None:
                out.append(last_step - detected)
                detected, last_step = None, None
            if detected is None:
                detected = t
        elif kind == ev.FIRST_STEP and detected is not None:
            last_step = t
        elif kind == ev.PROCESS_START and detected is not None and last_step is not None:
            # every rank of a generation starts before any rank's first step (rendezvous), so
            # a start after a first step is a new generation: an unlogged failure or a resize
            out.append(last_step - detected)
            detected, last_step = None, None
    if detected is not None and last_step is not None:
        out.append(last_step - detected)
    return out


def _num(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)
