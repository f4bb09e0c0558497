"""``tierckpt simulate``: Monte Carlo waste of a job with failures, next to the analytic
values, and the empirically best interval from a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

from tierckpt.cli import _planinputs
from tierckpt.cli._app import command
from tierckpt.cli._render import (
    Curve,
    Points,
    config_errors,
    console,
    emit_json,
    pct,
    plot_waste,
)
from tierckpt.errors import ConfigError
from tierckpt.policy import plan as planlib
from tierckpt.policy import simulate as simlib
from tierckpt.policy.units import format_duration, parse_duration

DEFAULT_WEIBULL_SHAPE = 0.7
"""Weibull shape used when --failures weibull is given without --shape (failures cluster)."""
FAILURE_BUDGET = 2e6
"""Simulated failures (replicas × job length / M) the default replica count aims at."""


@command()
def simulate(
    blocking: Annotated[str | None, typer.Option(help="C: seconds blocked per save.")] = None,
    restart: Annotated[str | None, typer.Option(help="R: restart cost per failure.")] = None,
    write_time: Annotated[str | None, typer.Option(help="W: background write time.")] = None,
    job_mtbf: Annotated[str | None, typer.Option(help="Job MTBF: 12h.")] = None,
    node_mtbf: Annotated[str | None, typer.Option(help="Node MTBF (with --nodes).")] = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes in the job.")] = None,
    job_length: Annotated[str, typer.Option(help="Training time the job needs: 365d.")
    ] = "365d",
    interval: Annotated[str | None, typer.Option(
        help="τ: training time between saves (default: Young's sqrt(2CM)).")] = None,
    failures: Annotated[str, typer.Option(help="exponential | weibull.")] = "exponential",
    shape: Annotated[float | None, typer.Option(
        help=f"Weibull shape, below 1 for clustered failures (default: {DEFAULT_WEIBULL_SHAPE}).")
    ] = None,
    replicas: Annotated[int | None, typer.Option(
        help="Simulated jobs (default: 200, fewer for very long jobs: ~2M failures in all).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed (results are reproducible).")] = 0,
    confidence: Annotated[float, typer.Option(help="Confidence level of the CI.")] = 0.95,
    do_sweep: Annotated[bool, typer.Option("--sweep/--no-sweep",
                                           help="Also sweep intervals for the best one.")
    ] = True,
    points: Annotated[int, typer.Option(help="Intervals in the sweep.")] = 25,
    sweep_replicas: Annotated[int | None, typer.Option(
        help="Simulated jobs per sweep point (default: a quarter of --replicas, at least 10).")
    ] = None,
    from_events: Annotated[Path | None, typer.Option(help="events.jsonl: measured C, W, R.")
    ] = None,
    from_drill: Annotated[Path | None, typer.Option(
        help="drill-report.json: measured C, W, R.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (docs/planning.md).")
    ] = False,
    plot: Annotated[Path | None, typer.Option(
        help="Draw simulated points over the analytic curve to this PNG.")] = None,
) -> None:
    """Simulate failures, saves and restarts; compare simulated waste with the formula."""
    with config_errors():
        doc = simulate_report(
            blocking=blocking, restart=restart, write_time=write_time, job_mtbf=job_mtbf,
            node_mtbf=node_mtbf, nodes=nodes, job_length=job_length, interval=interval,
            failures=failures, shape=shape, replicas=replicas, seed=seed,
            confidence=confidence, do_sweep=do_sweep, points=points,
            sweep_replicas=sweep_replicas, from_events=from_events, from_drill=from_drill)
        if plot is not None:
            _plot(plot, doc)
    if as_json:
        emit_json(doc)
    else:
        _render(doc, plot)


def simulate_report(*, blocking: str | None, restart: str | None, write_time: str | None,
                    job_mtbf: str | None, node_mtbf: str | None, nodes: int | None,
                    job_length: str, interval: str | None, failures: str, shape: float | None,
                    replicas: int | None, seed: int, confidence: float, do_sweep: bool,
                    points: int, sweep_replicas: int | None, from_events: Path | None = None,
                    from_drill: Path | None = None) -> dict[str, Any]:
    """The ``--json`` document (schema in docs/planning.md); ConfigError names the flag."""
    inp = _planinputs.resolve(blocking=blocking, restart=restart, write_time=write_time,
                              job_mtbf=job_mtbf, node_mtbf=node_mtbf, nodes=nodes,
                              from_events=from_events, from_drill=from_drill)
    C = _planinputs.require(inp.C, "--blocking")
    R = _planinputs.require(inp.R, "--restart")
    k = _shape(failures, shape)
    job_s = parse_duration(job_length, "--job-length")
    if replicas is None:  # keep the default run to a few seconds: ~2M simulated failures
        replicas = int(min(max(FAILURE_BUDGET * inp.M / job_s, 20), 200))
    if sweep_replicas is None:
        sweep_replicas = max(replicas // 4, 10)
    for flag, n in (("--replicas", replicas), ("--points", points),
                    ("--sweep-replicas", sweep_replicas)):
        if n < 2:
            raise ConfigError(f"{flag} must be at least 2, got {n}")
    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence must be between 0 and 1, got {confidence}")
    model = simlib.JobModel(C=C, M=inp.M, R=R, W=inp.W or 0.0,
                            job_s=job_s,
                            failures=simlib.Failures(failures), shape=k)
    tau = (parse_duration(interval, "--interval") if interval is not None
           else planlib.young_interval(C, inp.M))
    res = simlib.simulate(model, tau, replicas=replicas, seed=seed, confidence=confidence)
    first = planlib.waste(C, tau, inp.M, R, W=model.W)
    doc: dict[str, Any] = {
        "inputs": {"C_s": C, "R_s": R, "W_s": inp.W, "job_mtbf_s": inp.M, "nodes": inp.nodes,
                   "job_s": model.job_s, "failures": model.failures.value, "shape": model.shape,
                   "replicas": replicas, "seed": seed, "confidence": confidence},
        "sources": inp.sources,
        "job_mtbf_s": inp.M,
        "interval_s": tau,
        "waste_fraction": res.waste_fraction,
        "ci": [res.ci_low, res.ci_high],
        "analytic": {"first_order": first.total, "exact_exponential": res.analytic_exact,
                     "first_order_in_ci": res.contains(first.total),
                     "exact_in_ci": res.contains(res.analytic_exact)},
        "waste_parts": {"ckpt": first.ckpt, "rework": first.rework, "restart": first.restart},
        "wall_s_mean": res.wall_s_mean,
        "failures_mean": res.failures_mean,
        "failures_in_save_mean": res.failures_in_save_mean,
        "failures_in_restart_mean": res.failures_in_restart_mean,
        "sweep": None,
    }
    if do_sweep:
        doc["sweep"] = _sweep(model, points=points, replicas=sweep_replicas, seed=seed,
                              confidence=confidence)
    return doc


def _shape(failures: str, shape: float | None) -> float:
    """The failure distribution's shape from ``--failures``/``--shape`` (1 = exponential)."""
    if failures not in {f.value for f in simlib.Failures}:
        raise ConfigError(f"--failures: unknown value {failures!r}; choose exponential or "
                          "weibull")
    if shape is not None and failures != simlib.Failures.WEIBULL.value:
        raise ConfigError("--shape applies only to --failures weibull")
    if shape is not None and not shape > 0:
        raise ConfigError(f"--shape must be > 0, got {shape}")
    if shape is not None:
        return shape
    return DEFAULT_WEIBULL_SHAPE if failures == simlib.Failures.WEIBULL.value else 1.0


def _sweep(model: simlib.JobModel, *, points: int, replicas: int, seed: int,
           confidence: float) -> dict[str, Any]:
    """The ``sweep`` part of the document: simulated waste over a range of intervals."""
    C, M = model.C, model.M
    sw = simlib.sweep(model, points=points, replicas=replicas, seed=seed,
                      confidence=confidence)
    return {
        "points": [{"interval_s": r.interval_s, "waste_fraction": r.waste_fraction,
                    "ci_low": r.ci_low, "ci_high": r.ci_high,
                    "analytic_first_order": r.analytic_first_order,
                    "analytic_exact": r.analytic_exact} for r in sw.results],
        "best_interval_s": sw.best.interval_s,
        "best_waste_fraction": sw.best.waste_fraction,
        "young_interval_s": planlib.young_interval(C, M),
        "daly_interval_s": planlib.daly_interval(C, M),
        "exact_best_interval_s": planlib.best_exact_interval(C, M, model.R, W=model.W),
    }


def _render(doc: dict[str, Any], plot: Path | None) -> None:
    out = console()
    inp, an = doc["inputs"], doc["analytic"]
    fail = inp["failures"] + (f" (shape {inp['shape']:g})" if inp["failures"] == "weibull"
                              else "")
    out.print(f"{inp['replicas']} jobs of {format_duration(inp['job_s'])} training, "
              f"M = {format_duration(inp['job_mtbf_s'])}, {fail} failures, "
              f"C = {format_duration(inp['C_s'])}, R = {format_duration(inp['R_s'])}"
              + (f", W = {format_duration(inp['W_s'])}" if inp["W_s"] else "")
              + f", seed {inp['seed']}")
    t = Table(title=f"Waste at τ = {format_duration(doc['interval_s'])}")
    t.add_column("model")
    t.add_column("waste", justify="right")
    t.add_column(f"inside the {inp['confidence']:.0%} CI?", justify="center")
    t.add_row("simulated", f"[bold]{pct(doc['waste_fraction'])}[/]",
              f"[{pct(doc['ci'][0])}, {pct(doc['ci'][1])}]")
    t.add_row("first order C/τ + τ/2M + R/M", pct(an["first_order"]),
              _yes(an["first_order_in_ci"]))
    t.add_row("exact (exponential failures)", pct(an["exact_exponential"]),
              _yes(an["exact_in_ci"]))
    out.print(t)
    out.print(f"failures per job: {doc['failures_mean']:.1f} (during a save: "
              f"{doc['failures_in_save_mean']:.1f}, during a restart: "
              f"{doc['failures_in_restart_mean']:.1f})")
    sw = doc["sweep"]
    if sw is not None:
        out.print(f"best simulated interval: [bold]{format_duration(sw['best_interval_s'])}[/] "
                  f"({pct(sw['best_waste_fraction'])}); Young "
                  f"{format_duration(sw['young_interval_s'])}, Daly "
                  f"{format_duration(sw['daly_interval_s'])}, exact-model optimum "
                  f"{format_duration(sw['exact_best_interval_s'])}")
    if plot is not None:
        out.print(f"plot written to {plot}")


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[yellow]no[/]"


def _plot(path: Path, doc: dict[str, Any]) -> None:
    inp = doc["inputs"]
    C, R, W, M = inp["C_s"], inp["R_s"], inp["W_s"] or 0.0, inp["job_mtbf_s"]
    sw = doc["sweep"]
    if sw is not None:
        pts = sw["points"]
        sim = Points(label="simulated (CI)", taus=[p["interval_s"] for p in pts],
                     waste=[p["waste_fraction"] for p in pts],
                     low=[p["ci_low"] for p in pts], high=[p["ci_high"] for p in pts],
                     best=(sw["best_interval_s"], sw["best_waste_fraction"]))
        lo, hi = pts[0]["interval_s"], pts[-1]["interval_s"]
    else:
        sim = Points(label="simulated (CI)", taus=[doc["interval_s"]],
                     waste=[doc["waste_fraction"]], low=[doc["ci"][0]], high=[doc["ci"][1]])
        lo, hi = doc["interval_s"] / 8, doc["interval_s"] * 8
    taus = [float(x) for x in np.geomspace(lo, hi, 200)]
    first = [planlib.waste(C, t, M, R, W=W).total for t in taus]
    exact = [planlib.exact_waste(C, t, M, R, W=W) for t in taus]
    young = planlib.young_interval(C, M)
    curves = [Curve(label="first order C/τ + τ/2M + R/M", taus=taus, waste=first,
                    optimum=(young, planlib.waste(C, young, M, R, W=W).total)),
              Curve(label="exact (exponential failures)", taus=taus, waste=exact, style="--")]
    plot_waste(path, curves, [sim], title=f"Simulated vs analytic waste, M = {format_duration(M)}")
