"""The preemption drill's report: one JSON document and its Markdown rendering.

:func:`build_preempt_report` and :func:`render_preempt_markdown` are pure functions of
values; :func:`write_preempt_report` writes ``preempt-report.json`` and
``preempt-report.md`` next to the other drills' reports. Schema
(``"schema": "tierckpt.preempt-report/1"``) in docs/drills.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt._version import __version__
from tierckpt.drill.preempt_verdicts import PREEMPT_VERDICTS, TIERS
from tierckpt.drill.reportfile import write_report_files

if TYPE_CHECKING:
    from tierckpt.drill.chaos_verdicts import Verdict
    from tierckpt.drill.preempt import PreemptConfig
    from tierckpt.drill.preempt_verdicts import NoticePlan
    from tierckpt.drill.runs import RunResult

__all__ = ["PREEMPT_SCHEMA", "build_preempt_report", "render_preempt_markdown",
           "write_preempt_report"]

PREEMPT_SCHEMA = "tierckpt.preempt-report/1"


def build_preempt_report(*, cfg: PreemptConfig, plan: NoticePlan,
                         notice: Mapping[str, Any] | None, timings: Mapping[str, Any] | None,
                         verdicts: Sequence[Verdict], runs: Sequence[RunResult],
                         error: str | None, t0: float,
                         launcher_rc: int | None = None) -> dict[str, Any]:
    """The report document. ``ok`` only when every verdict of
    :data:`~tierckpt.drill.preempt_verdicts.PREEMPT_VERDICTS` ran and passed and the drill
    itself did not fail (``error``); a verdict that did not run is False."""
    by_name = {v.name: v for v in verdicts}
    flags = {name: bool(by_name[name].ok) if name in by_name else False
             for name in PREEMPT_VERDICTS}
    stop = by_name.get("stop")
    lost = by_name.get("lost_work")
    return {
        "schema": PREEMPT_SCHEMA, "tierckpt_version": __version__,
        "created_unix": time.time(), "duration_s": time.time() - t0,
        "config": {"command": list(cfg.command), "nproc": cfg.nproc, "nnodes": cfg.nnodes,
                   "world_size": cfg.world_size, "steps": cfg.steps, "seed": cfg.seed,
                   "rank": cfg.rank, "tier2": cfg.tier2, "out": str(cfg.out)},
        "plan": plan.as_dict(), "notice": dict(notice) if notice else None,
        "launcher_rc": launcher_rc,
        "stop_step": stop.facts.get("step") if stop else None,
        "lost_steps": lost.facts.get("lost_steps") if lost else None,
        "steps_after_notice": lost.facts.get("steps_after_notice") if lost else None,
        "timings": dict(timings) if timings else None,
        "verdicts": flags,
        "details": {v.name: v.as_dict() for v in verdicts},
        "runs": [{"name": r.name, "rc": r.rc, "start_s": r.t_start - t0,
                  "end_s": r.t_end - t0} for r in runs],
        "error": error,
        "ok": error is None and all(flags.values()),
    }


def _s(x: object) -> str:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))
    return f"{float(x):.3f} s" if ok else "—"  # type: ignore[arg-type]


def timing_rows(doc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(quantity, value)`` rows of the times the drill measured, for the table and the
    Markdown: notice → received, stopped, durable per tier (or why not), saved."""
    t = doc.get("timings") or {}
    rows = [("notice → every rank received it", _s(t.get("received_s"))),
            ("notice → every rank stopped", _s(t.get("stopped_s")))]
    durable = t.get("durable_s") or {}
    abandoned = t.get("abandoned") or {}
    for tier in TIERS:
        if tier in durable:
            rows.append((f"notice → durable on {tier}", _s(durable[tier])))
        elif tier in abandoned:
            rows.append((f"notice → durable on {tier}", f"not reached: {abandoned[tier]}"))
    rows.append(("notice → every rank's preempt_saved", _s(t.get("saved_s"))))
    rows.append(("grace left at the slowest rank", _s(t.get("remaining_s"))))
    return rows


def render_preempt_markdown(doc: Mapping[str, Any]) -> str:
    """``preempt-report.md``: the notice, the verdicts and the measured times."""
    c, n = doc["config"], doc.get("notice") or {}
    lines = [f"# tierckpt preemption drill — {'PASSED' if doc['ok'] else 'FAILED'}", "",
             f"Command: `{' '.join(c['command'])}`  ",
             f"{c['nnodes']} node(s) × {c['nproc']} ranks, {c['steps']} steps, seed "
             f"{c['seed']}, tier 2 `{c['tier2']}`", ""]
    if n:
        lines += [f"Notice: {n['signal']} to the {n['target']} after step {n['seen']} "
                  f"(planned after step {n['planned_step']}); every rank stopped after step "
                  f"{doc['stop_step']}; launcher exit status {doc['launcher_rc']}.", ""]
    if doc.get("error"):
        lines += [f"**Stopped early:** {doc['error']}", ""]
    lines += ["| verdict | result | detail |", "|---|---|---|"]
    for name in PREEMPT_VERDICTS:
        d = doc["details"].get(name, {})
        detail = str(d.get("detail", "did not run")).replace("|", "/")
        lines.append(f"| {name} | {'pass' if doc['verdicts'][name] else 'FAIL'} | {detail} |")
    if doc.get("timings"):
        lines += ["", "## Measured", "", "| from the notice sent | time |", "|---|---|"]
        lines += [f"| {k.removeprefix('notice → ')} | {v.replace('|', '/')} |"
                  for k, v in timing_rows(doc)]
    lines += ["", f"Work lost: {doc.get('lost_steps')} step(s) redone; steps trained after "
              f"the notice: {doc.get('steps_after_notice')}.", ""]
    return "\n".join(lines)


def write_preempt_report(doc: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the JSON and Markdown into ``out``; returns their paths (also stored in
    ``doc["files"]``)."""
    return write_report_files(doc, out, "preempt-report", render_preempt_markdown)
