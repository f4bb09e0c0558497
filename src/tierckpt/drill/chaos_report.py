"""The chaos drill's report: one JSON document and its Markdown rendering.

:func:`build_chaos_report` and :func:`render_chaos_markdown` are pure functions of values;
:func:`write_chaos_report` writes ``chaos-report.json`` and ``chaos-report.md`` next to the
resume drills' reports. Schema (``"schema": "tierckpt.chaos-report/1"``) in docs/drills.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt._version import __version__
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.reportfile import write_report_files

if TYPE_CHECKING:
    from tierckpt.drill.chaos_verdicts import CyclePlan

__all__ = ["CHAOS_SCHEMA", "build_chaos_report", "render_chaos_markdown",
           "write_chaos_report"]

CHAOS_SCHEMA = "tierckpt.chaos-report/1"


def build_chaos_report(*, config: Mapping[str, Any], catalogue: Mapping[str, Any],
                       plan: Sequence[CyclePlan], start: Mapping[str, Any],
                       cycles: Sequence[Mapping[str, Any]], final: Mapping[str, Any] | None,
                       restarts: int, peaks: Mapping[int, int], bound: int | None,
                       facts: Mapping[str, Any], error: str | None,
                       t0: float) -> dict[str, Any]:
    """The report document: the cycles (each with its faults, verdicts and violations),
    per-kind outcomes, totals and the final checks. ``ok`` only when every planned cycle
    ran, nothing was violated and the drill itself did not fail (``error``)."""
    summary = cv.summarize([*cycles, *([final] if final else []), start])
    fired: dict[str, int] = {}
    for c in cycles:
        for f in c["faults"]:
            if f["fired"] and not f.get("implied"):
                fired[f["kind"]] = fired.get(f["kind"], 0) + 1
    records = [start, *cycles, *([final] if final else [])]
    violations = [{"cycle": c["index"], "invariant": name,
                   "detail": c["verdicts"][name]["detail"]}
                  for c in records for name in c["violations"]]
    totals = {"cycles_planned": len(plan), "cycles": len(cycles),
              "faults": sum(fired.values()), "faults_by_kind": fired, "restarts": restarts,
              "violations": len(violations),
              "violations_by_invariant": summary["violations_by_invariant"],
              "tier1_peak": max(peaks.values(), default=0), "tier1_peak_by_node": dict(peaks),
              "tier1_bound": bound, "wall_s": time.time() - t0}
    complete = final is not None and len(cycles) == len(plan) and error is None
    return {"schema": CHAOS_SCHEMA, "tierckpt_version": __version__,
            "created_unix": time.time(), "config": dict(config), "catalogue": dict(catalogue),
            "facts": dict(facts), "plan": [p.as_dict() for p in plan],
            "start": dict(start), "cycles": [dict(c) for c in cycles],
            "final": dict(final) if final else None, "by_kind": summary["by_kind"],
            "totals": totals, "violations": violations, "error": error,
            "ok": complete and not violations}


def _cell(text: object) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def render_chaos_markdown(doc: Mapping[str, Any]) -> str:
    """``chaos-report.md``: fault kind → cycles → outcome, totals, violations, cycles."""
    c, t = doc["config"], doc["totals"]
    lines = [f"# tierckpt chaos drill — {'PASSED' if doc['ok'] else 'FAILED'}", "",
             f"Command: `{' '.join(c['command'])}`  ",
             f"{c['nnodes']} node(s) × {c['nproc']} rank(s), {c['steps']} steps, seed "
             f"{c['seed']}, {t['cycles']}/{t['cycles_planned']} cycles, tier 2 `{c['tier2']}`"
             + (f", tier 0 `{c['tier0']}`" if c.get("tier0") else "")
             + (", under `tierckpt run` (heal)" if c.get("heal") else ""), ""]
    if doc.get("error"):
        lines += [f"**The drill stopped early:** {_cell(doc['error'])}", ""]
    lines += ["| fault kind | cycles | passed | violated |", "|---|---|---|---|"]
    for kind, k in doc["by_kind"].items():
        lines.append(f"| {kind} | {', '.join(map(str, k['cycles']))} | {k['passed']} | "
                     f"{k['violated']} |")
    skipped = [f"{k} ({v['how']})" for k, v in doc["catalogue"].items() if not v["injectable"]]
    if skipped:
        lines += ["", "Not injected here: " + "; ".join(skipped) + "."]
    bound = t["tier1_bound"]
    lines += ["", "## Totals", "", "| cycles | faults | restarts | violations | tier-1 peak / "
              "bound | wall time |", "|---|---|---|---|---|---|",
              f"| {t['cycles']} | {t['faults']} "
              f"({', '.join(f'{k} {n}' for k, n in t['faults_by_kind'].items())}) | "
              f"{t['restarts']} | {t['violations']} | {t['tier1_peak']} / "
              f"{'—' if bound is None else bound} | {t['wall_s']:.0f} s |", ""]
    if doc["violations"]:
        lines += ["## Violations", "", "| cycle | invariant | detail |", "|---|---|---|"]
        lines += [f"| {v['cycle']} | {v['invariant']} | {_cell(v['detail'])[:300]} |"
                  for v in doc["violations"]]
        lines.append("")
    lines += ["## Cycles", "", "| # | faults | resumed from | recovery | outcome |",
              "|---|---|---|---|---|"]
    for cyc in doc["cycles"]:
        faults = ", ".join(f["label"] + ("" if f["fired"] else " (not fired)")
                           + (f" → {f['landed']}" if f.get("landed") else "")
                           for f in cyc["faults"] if not f.get("implied"))
        resumed = ", ".join(str(r["step"]) for r in cyc["resumed"]) or "—"
        rec = "—" if cyc["recovery_s"] is None else f"{cyc['recovery_s']:.1f} s"
        outcome = "ok" if not cyc["violations"] else "VIOLATED: " + ", ".join(cyc["violations"])
        lines.append(f"| {cyc['index']} | {_cell(faults)} | {resumed} | {rec} | {outcome} |")
    lines.append("")
    return "\n".join(lines)


def write_chaos_report(doc: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the JSON and Markdown into ``out``; returns their paths (also in
    ``doc["files"]``)."""
    return write_report_files(doc, out, "chaos-report", render_chaos_markdown)
