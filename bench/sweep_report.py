"""The sweep's results (``bench.sweep``) as ``<stamp>-sweep.json``, a Markdown table and one
PNG: seconds against bytes per rank per metric (a line per world size, its fit dashed), the
RAM ratio, and the planner's τ and waste against GPUs on log axes (Llama 3 marked).

JSON layout (seconds, bytes, decimal GB/s)::

    schema, started, finished, wall_seconds, machine, sizes, worlds, repeats
    points   [{world, size_bytes, bytes, bytes_per_rank, C, durable, restore_cold (each a
              Measurement, restore with cold), ram {peak_extra_bytes, ratio, ...}, write_s,
              commit_s, pg_init_seconds, start_seconds, manager_open_seconds,
              wall_seconds (first point of a spawn)} | {world, size_bytes, skipped}]
    fixed    {world: the 1 MiB point, same keys}
    pg_init_seconds, process_start_seconds  {world: median over the world's spawns}
    fits     {world: {C | durable | restore_cold: {intercept, slope, r2, points, rate_gbps},
              ram: {intercept, slope, r2, points}} (None below two sizes)}
    flatness {bytes_per_rank, metrics {metric: {world: {seconds, vs_first}}}}
    planner  {world, bytes_per_gpu, basis, C_s, W_s, R_s, gpu_mtbf_s, rows [{gpus,
              job_mtbf_s, interval_s, waste, waste_parts, exact_waste, llama3, ...}]}
              | {skipped}
    errors   [str]

``render_markdown`` reads only that dict, so a results file can be re-rendered later.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.config import MiB
from tierckpt.policy.units import format_duration

_LABELS = {"C": "C: save() blocks", "durable": "durable: save() → committed",
           "restore_cold": "cold restore()"}


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB" if n >= MiB else f"{n / MiB:.2f} MiB"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _points(r: dict[str, Any]) -> list[str]:
    lines = ["## Points (slowest rank, best of repeats)", "",
             "| world | state | per rank | C s | durable s | write s | commit s | "
             "cold restore s | raw read of its files s | peak extra RAM | × state |",
             "|---" * 11 + "|"]
    for p in r["points"]:
        head = f"| {p['world']} | {_mib(p['size_bytes'])} |"
        if "skipped" in p:
            lines.append(f"{head} skipped: {p['skipped']} |" + " |" * 8)
            continue
        cold = "" if p["restore_cold"]["cold"] else " (not cold)"
        lines.append(f"{head} {_mib(p['bytes_per_rank'])} | {_s(p['C']['seconds'])} | "
                     f"{_s(p['durable']['seconds'])} | {_s(p['write_s'])} | "
                     f"{_s(p['commit_s'])} | {_s(p['restore_cold']['seconds'])}{cold} | "
                     f"{_s(p.get('own_files_read', {}).get('seconds'))} | "
                     f"{_mib(p['ram']['peak_extra_bytes'])} | {p['ram']['ratio']:.2f} |")
    return [*lines, ""]


def _fits(r: dict[str, Any]) -> list[str]:
    lines = ["## Fits over bytes per rank (least squares)", "",
             "seconds = a + bytes_per_rank / rate; RAM: extra = a + ratio × bytes_per_rank.", "",
             "| metric | world | a (fixed) | rate GB/s or ratio | r² | points |",
             "|---|---|---|---|---|---|"]
    for metric in (*_LABELS, "ram"):
        for w, fits in r["fits"].items():
            f = fits[metric]
            label = _LABELS.get(metric, "peak extra RAM")
            if f is None:
                lines.append(f"| {label} | {w} | — | — | — | < 2 sizes |")
            elif metric == "ram":
                lines.append(f"| {label} | {w} | {_mib(f['intercept'])} | "
                             f"{f['slope']:.3f}× | {f['r2']:.4f} | {f['points']} |")
            else:
                lines.append(f"| {label} | {w} | {f['intercept']:.3g} s | "
                             f"{_s(f['rate_gbps'])} | {f['r2']:.4f} | {f['points']} |")
    flat = r["flatness"]
    if flat["metrics"]:
        worlds = list(r["fits"])
        lines += ["", f"At {_mib(flat['bytes_per_rank'])} per rank (each world's fit): flat "
                      "in world size means every ratio ≈ 1.", "",
                  "| metric | " + " | ".join(f"w{w} s (× w{worlds[0]})" for w in worlds) + " |",
                  "|---|" + "---|" * len(worlds)]
        for metric, at in flat["metrics"].items():
            cells = [f"{_s(at[w]['seconds'])} ({_s(at[w]['vs_first'])}×)" if w in at else "—"
                     for w in worlds]
            lines.append(f"| {_LABELS[metric]} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _fixed(r: dict[str, Any]) -> list[str]:
    lines = ["## Fixed overheads", "",
             "Process start (spawn → rank function: interpreter, imports, process group) and "
             "process-group init alone: median over the world's rank processes. The rest: the "
             "1 MiB point.", "",
             "| world | process start s | pg init s | manager open s | C s | durable s | "
             "write s | commit s | cold restore s |", "|---|---|---|---|---|---|---|---|---|"]
    for w, p in r["fixed"].items():
        if "skipped" in p:
            lines.append(f"| {w} | skipped: {p['skipped']} |" + " |" * 7)
            continue
        lines.append(f"| {w} | {_s(r['process_start_seconds'].get(w))} | "
                     f"{_s(r['pg_init_seconds'].get(w))} | "
                     f"{_s(p['manager_open_seconds'])} | {_s(p['C']['seconds'])} | "
                     f"{_s(p['durable']['seconds'])} | {_s(p['write_s'])} | "
                     f"{_s(p['commit_s'])} | {_s(p['restore_cold']['seconds'])} |")
    return [*lines, ""]


def _planner(r: dict[str, Any]) -> list[str]:
    pl = r["planner"]
    lines = ["## Planner across scale (tierckpt.policy.plan, Young)", ""]
    if "skipped" in pl:
        return [*lines, f"**Skipped:** {pl['skipped']}", ""]
    lines += [f"Bytes per GPU: {_mib(pl['bytes_per_gpu'])} — {pl['basis']}. C = "
              f"{pl['C_s']:.3g} s, W = {pl['W_s']:.3g} s, R = {pl['R_s']:.3g} s "
              f"({pl['note']}). Per-GPU MTBF {format_duration(pl['gpu_mtbf_s'])} (Llama 3: "
              "419 interruptions in 54 days on 16,384 GPUs, **bold**).", "",
              "| GPUs | job MTBF | τ | C/τ | (τ/2 + W)/M | R/M | waste | exact |",
              "|---|---|---|---|---|---|---|---|"]
    for row in pl["rows"]:
        parts = row["waste_parts"]
        b = "**" if row["llama3"] else ""
        lines.append(f"| {b}{row['gpus']:,}{b} | {format_duration(row['job_mtbf_s'])} | "
                     f"{format_duration(row['interval_s'])} | {parts['ckpt']:.3%} | "
                     f"{parts['rework']:.3%} | {parts['restart']:.3%} | "
                     f"{b}{row['waste']:.3%}{b} | {row['exact_waste']:.3%} |")
    return [*lines, ""]


def render_markdown(r: dict[str, Any]) -> str:
    """The whole results dict as Markdown."""
    m = r["machine"]
    lines = [f"# tierckpt cost curves — {r['started']}", "",
             f"States {', '.join(_mib(s) for s in r['sizes'])} (total over ranks); worlds "
             f"{', '.join(map(str, r['worlds']))}; best of {r['repeats']}; "
             f"{m['cores']} cores, {m['mem_total_bytes'] / 2**30:.1f} GiB, {m['target_fs']} "
             f"at {m['target_mount']}; load {m['loadavg_start'][0]:.2f}; "
             f"{r['wall_seconds']:.0f} s in all.", ""]
    lines += _points(r) + _fits(r) + _fixed(r) + _planner(r)
    if r["errors"]:
        lines += ["## Errors", "", *(f"- {e}" for e in r["errors"]), ""]
    return "\n".join(lines)


def _mib_axis(ax: Any, r: dict[str, Any], label: str) -> None:
    """Log x in MiB per rank, ticks at the measured bytes per rank, plain numbers."""
    from matplotlib import ticker

    ax.set(xscale="log", xlabel=label)
    ax.set_xticks(sorted({p["bytes_per_rank"] / MiB for p in r["points"] if "skipped" not in p}))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.0f}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.tick_params(axis="x", labelsize=7, labelrotation=45)
    ax.legend(fontsize=8)


def _plot_seconds(ax: Any, r: dict[str, Any], metric: str) -> None:
    for w, fits in r["fits"].items():
        pts = sorted((p["bytes_per_rank"], p[metric]["seconds"]) for p in r["points"]
                     if p["world"] == int(w) and "skipped" not in p)
        if not pts:
            continue
        line = ax.plot([x / MiB for x, _ in pts], [y for _, y in pts], "o-", label=f"world {w}")
        f = fits[metric]
        if f is not None:  # a + b·x is curved on log axes: a grid, without values ≤ 0
            lo, hi = pts[0][0], pts[-1][0]
            grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
            fit = [(x / MiB, f["intercept"] + f["slope"] * x) for x in grid]
            fit = [(x, y) for x, y in fit if y > 0]
            ax.plot([x for x, _ in fit], [y for _, y in fit], "--", color=line[0].get_color(),
                    alpha=0.5)
    ax.set(yscale="log", ylabel="seconds", title=_LABELS[metric])
    _mib_axis(ax, r, "MiB per rank (least-squares fit dashed)")


def _plot_ram(ax: Any, r: dict[str, Any]) -> None:
    for w in r["fits"]:
        pts = sorted((p["bytes_per_rank"], p["ram"]["ratio"]) for p in r["points"]
                     if p["world"] == int(w) and "skipped" not in p)
        ax.plot([x / MiB for x, _ in pts], [y for _, y in pts], "o-", label=f"world {w}")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(ylabel="peak extra RAM ÷ state", title="RAM (worst rank)")
    _mib_axis(ax, r, "MiB per rank")


def _plot_planner(ax_tau: Any, ax_waste: Any, pl: dict[str, Any]) -> None:
    rows = pl["rows"]
    n = [row["gpus"] for row in rows]
    ax_tau.plot(n, [row["interval_s"] / 60 for row in rows], "o-", label="τ (Young)")
    ax_tau.plot(n, [row["job_mtbf_s"] / 60 for row in rows], "s--", label="job MTBF M")
    for key, label, style in (("ckpt", "C/τ", "x-"), ("rework", "(τ/2+W)/M", ".--"),
                              ("restart", "R/M", ".:")):
        ax_waste.plot(n, [row["waste_parts"][key] * 100 for row in rows], style, label=label)
    ax_waste.plot(n, [row["waste"] * 100 for row in rows], "o-", color="black", label="waste")
    for row in rows:
        if row["llama3"]:
            ax_tau.plot([row["gpus"]], [row["interval_s"] / 60], "r*", ms=14, label="Llama 3")
            ax_waste.plot([row["gpus"]], [row["waste"] * 100], "r*", ms=14, label="Llama 3")
    ax_tau.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="minutes",
               title=f"planner: τ at {pl['bytes_per_gpu'] / MiB:.0f} MiB per GPU")
    ax_waste.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="% of wall time",
                 title="planner: waste by part")
    ax_tau.legend(fontsize=8)
    ax_waste.legend(fontsize=8)


def plot(r: dict[str, Any], path: Path) -> Path:
    """Draw the six panels into ``path`` (PNG, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for ax, metric in zip(axes[0], _LABELS, strict=True):
        _plot_seconds(ax, r, metric)
    _plot_ram(axes[1][0], r)
    if "skipped" in r["planner"]:
        for ax in axes[1][1:]:
            ax.text(0.5, 0.5, f"planner skipped:\n{r['planner']['skipped']}", ha="center",
                    va="center", wrap=True, transform=ax.transAxes)
    else:
        _plot_planner(axes[1][1], axes[1][2], r["planner"])
    fig.suptitle(f"tierckpt cost curves — {r['started']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_sweep(r: dict[str, Any], out_dir: Path, stamp: str) -> tuple[Path, Path, Path]:
    """Write ``<stamp>-sweep.json``, ``.md`` and ``.png`` into ``out_dir``; return the paths."""
    return write_results(r, out_dir / f"{stamp}-sweep", plot, render_markdown)


def write_results(r: dict[str, Any], base: Path,
                  plot_fn: Callable[[dict[str, Any], Path], Path],
                  render: Callable[[dict[str, Any]], str]) -> tuple[Path, Path, Path]:
    """Write ``base`` + ``.json``, ``.md`` and ``.png`` (``plot_fn``'s, named in the JSON as
    ``plot``); return the three paths."""
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
    png = plot_fn(r, base.with_suffix(".png"))
    r["plot"] = str(png)
    json_path.write_text(json.dumps(r, indent=2) + "\n")
    md_path.write_text(render(r))
    return json_path, md_path, png
