"""The drill report: one JSON document (schema in docs/drills.md), its Markdown rendering
and the timeline picture.

:func:`build_report` assembles the document from the drills' results; :func:`verdicts`,
:func:`timeline_marks` and :func:`render_markdown` are pure functions of values;
:func:`write_report` writes ``drill-report.json``, ``drill-report.md`` and
``drill-timeline.png`` into the drill's output directory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tierckpt._version import __version__
from tierckpt.drill.reportfile import write_report_files
from tierckpt.runtime import events as ev

if TYPE_CHECKING:
    from tierckpt.drill.drills import DrillConfig
    from tierckpt.drill.runs import RunResult

__all__ = ["SCHEMA", "VERDICTS", "build_report", "render_markdown", "timeline_marks",
           "verdicts", "write_report"]

SCHEMA = "tierckpt.drill-report/1"
VERDICTS = ("kill", "continuity", "reshard", "tier2")
_MARKS = {ev.SAVE_COMMITTED: "save", ev.FAILURE_DETECTED: "kill", ev.PROCESS_START: "start",
          ev.PG_READY: "pg ready", ev.CHECKPOINT_CHOSEN: "chosen", ev.RESTORE_DONE: "restored",
          ev.FIRST_STEP: "first step"}


def verdicts(drills: Mapping[str, Mapping[str, Any]]) -> dict[str, bool]:
    """One boolean per verdict; a drill that did not run failed."""
    return {name: bool(drills.get(name, {}).get("ok")) for name in VERDICTS}


def timeline_marks(events: Iterable[Mapping[str, Any]], t0: float) -> list[dict[str, Any]]:
    """The events worth drawing, ``t_s`` seconds after ``t0``; saves from rank 0 only."""
    out = []
    for e in events:
        label = _MARKS.get(str(e.get("event")))
        if label is None or (label == "save" and e.get("rank") not in (0, None)):
            continue
        out.append({"kind": label, "t_s": float(e["t"]) - t0, "rank": e.get("rank"),
                    "step": e.get("step")})
    return out


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def build_report(cfg: DrillConfig, drills: Mapping[str, dict[str, Any]],
                 runs: list[RunResult], t0: float) -> dict[str, Any]:
    """The report document for ``drills`` (results keyed by drill name) and ``runs``."""
    ref, kill = drills.get("reference", {}), drills.get("kill", {})
    tier2 = drills.get("tier2", {})
    v = verdicts(drills)
    restart = None
    if kill.get("R_s") is not None:
        restart = {k: kill.get(k) for k in ("R_s", "parts", "resumed_from_step", "kill",
                                            "unfinished_saves",
                                            "lost_steps")}
    return {
        "schema": SCHEMA,
        "tierckpt_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        "duration_s": time.time() - t0,
        "config": {"command": list(cfg.command), "nproc": cfg.nproc, "nnodes": cfg.nnodes,
                   "world_size": cfg.world_size, "steps": cfg.steps, "seed": cfg.seed,
                   "tier2": cfg.tier2, "reshard_sizes": list(cfg.reshard_sizes),
                   "out": str(cfg.out)},
        "measured": {"C_s": _num(ref.get("C_s")), "W_s": _num(ref.get("W_s")),
                     "R_s": _num(kill.get("R_s"))},
        "restart": restart,
        "bytes": {"checkpoint": ref.get("checkpoint_bytes"),
                  "restore": (kill.get("restore") or {}).get("bytes"),
                  "tier2_restore": tier2.get("tier2_bytes")},
        "tier2_restore_s": _num(tier2.get("restore_s")),
        "verdicts": v,
        "ok": all(v.values()),
        "drills": {k: dict(d) for k, d in drills.items()},
        "runs": [{"name": r.name, "rc": r.rc, "start_s": r.t_start - t0,
                  "end_s": r.t_end - t0, "marks": timeline_marks(r.events, t0)}
                 for r in runs],
    }


def _fmt(x: object, unit: str = " s", digits: int = 3) -> str:
    n = _num(x)
    return "—" if n is None else f"{n:.{digits}f}{unit}"


def render_markdown(doc: Mapping[str, Any]) -> str:
    """``drill-report.md``: verdicts, measured C/W/R, R's parts, and each drill's facts."""
    m, d = doc["measured"], doc["drills"]
    lines = [f"# tierckpt drill report — {'PASSED' if doc['ok'] else 'FAILED'}", "",
             f"Command: `{' '.join(doc['config']['command'])}`  ",
             f"{doc['config']['nnodes']} node(s) × {doc['config']['nproc']} ranks, "
             f"{doc['config']['steps']} steps, seed {doc['config']['seed']}, "
             f"tier 2 `{doc['config']['tier2']}`", "", "| drill | verdict | detail |",
             "|---|---|---|"]
    for name in ("reference", *VERDICTS):
        res = d.get(name, {})
        detail = str(res.get("summary") or res.get("error") or "").replace("|", "/")
        lines.append(f"| {name} | {'pass' if res.get('ok') else 'FAIL'} | {detail} |")
    lines += ["", "## Measured", "", "| C (blocking per save) | W (background write) | "
              "R (kill → first step) | tier-2 restore |", "|---|---|---|---|",
              f"| {_fmt(m['C_s'])} | {_fmt(m['W_s'])} | {_fmt(m['R_s'])} | "
              f"{_fmt(doc.get('tier2_restore_s'))} |", ""]
    if doc.get("restart"):
        r = doc["restart"]
        lines += ["## R, part by part (slowest rank)", "", "| part | seconds |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v, '')} |" for k, v in (r.get("parts") or {}).items()]
        writing = r.get("unfinished_saves") or []
        note = (f" The save of step {', '.join(map(str, writing))} was still being written when "
                "the rank died: an unfinished save never counts, so the newest committed step "
                "was resumed." if writing else "")
        lines += ["", f"Killed rank {r['kill']['rank']} (pid {r['kill']['pid']}) after step "
                  f"{r['kill']['after_step']}; resumed from step {r['resumed_from_step']} "
                  f"({r['lost_steps']} steps redone).{note}", ""]
    res = d.get("reshard", {})
    if res.get("runs"):
        lines += ["## Reshard", "", f"From the {res['saved_world_size']}-rank checkpoint of "
                  f"step {res['checkpoint_step']}:", "",
                  "| world size | loaded | loss before | loss after | reference after | "
                  "samples |", "|---|---|---|---|---|---|"]
        for r in res["runs"]:
            lines.append(f"| {r['world_size']} | {r['loaded']} | {_fmt(r['loss_before'], '', 4)}"
                         f" | {_fmt(r['loss_after'], '', 4)} | "
                         f"{_fmt(r['loss_reference_after'], '', 4)} | "
                         f"{r['samples']['detail']} |")
        lines.append("")
    b = doc["bytes"]
    lines += ["## Bytes", "", f"Checkpoint (all ranks): {b.get('checkpoint')}; restore after "
              f"the kill: {b.get('restore')}; fetched from tier 2: {b.get('tier2_restore')}.",
              "", "Timeline: `drill-timeline.png`. Plan with the measured C and R: "
              "`tierckpt plan --from-drill drill-report.json --node-mtbf 32d --nodes 64`.", ""]
    return "\n".join(lines)


_LEGEND = {"kill": "kill (= failure detected)", "start": "process start",
           "restored": "restore done"}


def plot_timeline(doc: Mapping[str, Any], path: Path) -> None:
    """``drill-timeline.png``: one row per run on a shared time axis, with its marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"save": ("|", "tab:blue"), "kill": ("X", "tab:red"), "start": (">", "tab:gray"),
              "pg ready": ("s", "tab:purple"), "chosen": ("d", "tab:orange"),
              "restored": ("o", "tab:green"), "first step": ("*", "black")}
    runs = doc["runs"]
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * max(1, len(runs))))
    labelled: set[str] = set()
    for y, run in enumerate(runs):
        ax.plot([run["start_s"], run["end_s"]], [y, y], color="lightgray", lw=6,
                solid_capstyle="butt", zorder=1)
        for kind, (marker, color) in styles.items():
            xs = [mk["t_s"] for mk in run["marks"] if mk["kind"] == kind]
            if xs:
                ax.scatter(xs, [y] * len(xs), marker=marker, color=color, s=60, zorder=3,
                           label=None if kind in labelled else _LEGEND.get(kind, kind))
                labelled.add(kind)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=False))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), loc="upper center", ncol=len(uniq), fontsize=8,
                  bbox_to_anchor=(0.5, -0.25 if len(runs) < 4 else -0.12), frameon=False)
    ax.set_yticks(range(len(runs)), [r["name"] for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the drill started")
    ax.set_title("tierckpt drill timeline: saves, kill, restart, restore, first step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(doc: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the JSON, Markdown and PNG into ``out``; returns their paths (also stored in
    ``doc["files"]``)."""
    files = write_report_files(doc, out, "drill-report", render_markdown,
                               also={"png": str(out / "drill-timeline.png")})
    plot_timeline(doc, Path(files["png"]))
    return files
