"""``tierckpt plan``: the checkpoint interval (Young, Daly), its expected waste by cause, the
cost in node-days, a resize, and strategies side by side — from given or measured C, R, W.
With ``--notice 30s``: whether that grace is enough for an emergency save to each tier
(:mod:`tierckpt.cli._notice`); the interval too when an MTBF is given."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

from tierckpt.cli import _notice, _planinputs
from tierckpt.cli._app import command
from tierckpt.cli._render import Curve, config_errors, console, emit_json, pct, plot_waste
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.policy import plan as planlib
from tierckpt.policy.units import format_duration, parse_duration

# plan's options, each with its help; the flag is the parameter's name (--write-time).
_Blocking = Annotated[str | None, typer.Option(
    help="C: seconds training blocks per save (90s, 5s).")]
_Restart = Annotated[str | None, typer.Option(
    help="R: restart cost per failure (detect→training again): 15m.")]
_WriteTime = Annotated[str | None, typer.Option(
    help="W: background write time after staging (warns if longer than the interval).")]
_JobMtbf = Annotated[str | None, typer.Option(help="Job MTBF: 12h.")]
_NodeMtbf = Annotated[str | None, typer.Option(help="Node MTBF (with --nodes): 32d.")]
_Nodes = Annotated[int | None, typer.Option(help="Nodes in the job.")]
_Rule = Annotated[str, typer.Option(help="Recommended interval: young | daly.")]
_Resize = Annotated[int | None, typer.Option(help="Recompute for this many nodes.")]
_Compare = Annotated[list[str] | None, typer.Option(
    help="A strategy NAME:C=..,R=..[,W=..], repeatable; missing keys come from the flags. "
         "E.g. --compare sync:C=60s,R=15m --compare async:C=5s,R=5m")]
_FromEvents = Annotated[Path | None, typer.Option(
    help="events.jsonl: measured C, W, R (flags still win).")]
_FromDrill = Annotated[Path | None, typer.Option(
    help="drill-report.json: measured C, W, R (flags still win).")]
_AsJson = Annotated[bool, typer.Option("--json", help="Print JSON (docs/planning.md).")]
_Plot = Annotated[Path | None, typer.Option(help="Draw waste vs interval to this PNG.")]
_Notice = Annotated[list[str] | None, typer.Option(
    help="A grace period (30s, 2m), repeatable: can the emergency save reach each tier "
         "in it? No MTBF needed.")]
_Tier1 = Annotated[Path | None, typer.Option(
    help="Tier-1 root: measure from its events.jsonl (as --from-events).")]
_SizePerNode = Annotated[str | None, typer.Option(
    help="With --notice: checkpoint bytes each node writes (80GB).")]
_Tier0Rate = Annotated[str | None, typer.Option(
    help="With --notice: one node's copy into RAM (5GB/s); puts tier 0 in the chain.")]
_Tier1Rate = Annotated[str | None, typer.Option(
    help="With --notice: one node's write to tier 1 (1GB/s).")]
_Tier2Rate = Annotated[str | None, typer.Option(
    help="With --notice: one node's upload to tier 2, verified (200MB/s).")]
_StepTime = Annotated[str | None, typer.Option(
    help="With --notice: one training step (the stop waits for it): 2s.")]
_Margin = Annotated[str | None, typer.Option(
    help="With --notice: seconds kept free before the deadline (default 2s).")]


@command()
def plan(
    blocking: _Blocking = None,
    restart: _Restart = None,
    write_time: _WriteTime = None,
    job_mtbf: _JobMtbf = None,
    node_mtbf: _NodeMtbf = None,
    nodes: _Nodes = None,
    rule: _Rule = "young",
    resize: _Resize = None,
    compare: _Compare = None,
    from_events: _FromEvents = None,
    from_drill: _FromDrill = None,
    as_json: _AsJson = False,
    plot: _Plot = None,
    notice: _Notice = None,
    tier1: _Tier1 = None,
    size_per_node: _SizePerNode = None,
    tier0_rate: _Tier0Rate = None,
    tier1_rate: _Tier1Rate = None,
    tier2_rate: _Tier2Rate = None,
    step_time: _StepTime = None,
    margin: _Margin = None,
) -> None:
    """Checkpoint interval and expected waste: C/τ + τ/(2M) + R/M, τ = sqrt(2CM).

    With --notice GRACE: what an emergency save reaches before the kill."""
    with config_errors():
        events_path = _events_path(tier1, from_events)
        _notice_only(notice, {"--size-per-node": size_per_node, "--tier0-rate": tier0_rate,
                              "--tier1-rate": tier1_rate, "--tier2-rate": tier2_rate,
                              "--step-time": step_time, "--margin": margin})
        doc: dict[str, Any] = {}
        if not notice or job_mtbf is not None or node_mtbf is not None:
            doc = plan_report(blocking=blocking, restart=restart, write_time=write_time,
                              job_mtbf=job_mtbf, node_mtbf=node_mtbf, nodes=nodes, rule=rule,
                              resize=resize, compare=compare or [], from_events=events_path,
                              from_drill=from_drill)
            if plot is not None:
                _plot(plot, doc)
        if notice:
            inputs = _notice.resolve(events_path=events_path, size=size_per_node,
                                     tier0_rate=tier0_rate, tier1_rate=tier1_rate,
                                     tier2_rate=tier2_rate, step_time=step_time,
                                     blocking=blocking, margin=margin)
            doc["notice"] = _notice.report(notice, inputs)
    _show(doc, plot, as_json=as_json)


def _notice_only(notice: list[str] | None, flags: dict[str, str | None]) -> None:
    """ConfigError naming the ``flags`` given (not None) when no ``--notice`` is."""
    if not notice and (stray := [k for k, v in flags.items() if v is not None]):
        raise ConfigError(f"{', '.join(stray)}: only used with --notice GRACE")


def _show(doc: dict[str, Any], plot: Path | None, *, as_json: bool) -> None:
    """Print ``doc``: as JSON, or the interval table and the notice verdicts it holds."""
    if as_json:
        emit_json(doc)
        return
    if "interval_s" in doc:
        _render(doc, plot)
    if "notice" in doc:
        _notice.render(doc["notice"])


def _events_path(tier1: Path | None, from_events: Path | None) -> Path | None:
    """The event log measured: ``--tier1 DIR``'s or ``--from-events FILE``, not both."""
    if tier1 is None:
        return from_events
    if from_events is not None:
        raise ConfigError("give --tier1 DIR or --from-events FILE, not both")
    path = tier1 / layout.EVENTS
    if not path.is_file():
        raise ConfigError(f"--tier1: {str(tier1)!r} is not a tier-1 root with {layout.EVENTS} "
                          "(an events file goes to --from-events)")
    return path


def plan_report(*, blocking: str | None, restart: str | None, write_time: str | None,
                job_mtbf: str | None, node_mtbf: str | None, nodes: int | None, rule: str,
                resize: int | None, compare: list[str], from_events: Path | None,
                from_drill: Path | None) -> dict[str, Any]:
    """The ``--json`` document (schema in docs/planning.md); ConfigError names the flag."""
    inp = _planinputs.resolve(blocking=blocking, restart=restart, write_time=write_time,
                              job_mtbf=job_mtbf, node_mtbf=node_mtbf, nodes=nodes,
                              from_events=from_events, from_drill=from_drill)
    if rule not in {r.value for r in planlib.Rule}:
        raise ConfigError(f"--rule: unknown value {rule!r}; choose young or daly")
    strategies = [_parse_strategy(s, i, inp) for i, s in enumerate(compare, 1)]
    if inp.C is not None or not strategies:
        measured = any(inp.sources.get(k, "").startswith("measured") for k in ("C_s", "R_s"))
        base = planlib.Strategy(name="measured" if measured else "given",
                                C=_planinputs.require(inp.C, "--blocking"),
                                R=_planinputs.require(inp.R, "--restart"), W=inp.W or 0.0)
        strategies.insert(0, base)
    plans = planlib.compare(strategies, inp.M, rule=rule)
    main = plans[0]
    doc: dict[str, Any] = {
        "inputs": {"C_s": main.C, "R_s": main.R, "W_s": inp.W, "job_mtbf_s": inp.M,
                   "node_mtbf_s": inp.node_mtbf, "nodes": inp.nodes, "rule": rule},
        "sources": inp.sources,
        **_plan_json(main, inp.nodes),
        "warnings": _warnings(plans),
        "resize": None,
        "strategies": [{"name": p.name, "C_s": p.C, "R_s": p.R, "W_s": p.W,
                        **_plan_json(p, inp.nodes)} for p in plans],
    }
    if resize is not None:
        doc["resize"] = _resize(main, inp, resize, rule)
    return doc


def _plan_json(p: planlib.IntervalPlan, nodes: int | None) -> dict[str, Any]:
    return {
        "job_mtbf_s": p.M,
        "interval_s": p.interval_s,
        "young_interval_s": p.young_s,
        "daly_interval_s": p.daly_s,
        "waste_fraction": p.waste.total,
        "waste_parts": {"ckpt": p.waste.ckpt, "rework": p.waste.rework,
                        "restart": p.waste.restart},
        "exact_waste_fraction": p.exact_waste_fraction,
        "waste_node_days_per_month": (planlib.node_days_per_month(p.waste.total, nodes)
                                      if nodes is not None else None),
        "overlap": p.overlap,
    }


def _resize(main: planlib.IntervalPlan, inp: _planinputs.Inputs, nodes: int,
            rule: str) -> dict[str, Any]:
    if nodes < 1:
        raise ConfigError(f"--resize must be a positive node count, got {nodes}")
    if inp.node_mtbf is None:
        raise ConfigError("--resize needs the node MTBF: give --node-mtbf with --nodes, or "
                          "--job-mtbf with --nodes")
    M = planlib.job_mtbf(inp.node_mtbf, nodes)
    if main.C >= M:
        raise ConfigError(f"--resize {nodes}: job MTBF {format_duration(M)} is not longer "
                          f"than the blocking time {format_duration(main.C)}")
    p = planlib.plan_interval(main.C, M, main.R, W=main.W, rule=rule, name=main.name)
    return {"nodes": nodes, **_plan_json(p, nodes)}


def _parse_strategy(spec: str, index: int, inp: _planinputs.Inputs) -> planlib.Strategy:
    flag = f"--compare {spec!r}"
    name, sep, body = spec.partition(":")
    if not sep:
        name, body = f"strategy {index}", spec
    values: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, text = item.partition("=")
        k = key.strip().upper()
        if not eq or k not in {"C", "R", "W"}:
            raise ConfigError(f"{flag}: expected NAME:C=60s,R=15m[,W=30s], got {item!r}")
        values[k] = parse_duration(text, f"{flag} {k}", allow_zero=k != "C")
    C = values.get("C", inp.C)
    R = values.get("R", inp.R)
    if C is None or R is None:
        raise ConfigError(f"{flag}: give C= and R= (or --blocking/--restart for all)")
    if C >= inp.M:
        raise ConfigError(f"{flag}: C ({format_duration(C)}) must be smaller than the job MTBF "
                          f"({format_duration(inp.M)})")
    return planlib.Strategy(name=name.strip() or f"strategy {index}", C=C, R=R,
                            W=values.get("W", inp.W or 0.0))


def _warnings(plans: list[planlib.IntervalPlan]) -> list[str]:
    out = []
    for p in plans:
        if p.overlap:
            out.append(f"{p.name}: interval {format_duration(p.interval_s)} is shorter than the "
                       f"write time {format_duration(p.W)}: saves would overlap (each save "
                       "waits for the previous write); use faster storage or a longer interval")
        if p.waste.total > 0.2:
            out.append(f"{p.name}: waste {pct(p.waste.total)} is large: C, R or τ is not small "
                       "against M, so the first-order model is inaccurate (see "
                       "exact_waste_fraction or run `tierckpt simulate`)")
    return out


def _render(doc: dict[str, Any], plot: Path | None) -> None:
    out = console()
    inp, src = doc["inputs"], doc["sources"]
    out.print(f"job MTBF M = {format_duration(doc['job_mtbf_s'])} "
              f"({src.get('job_mtbf_s', 'given')})")
    for key, label in (("C_s", "C (blocking per save)"), ("R_s", "R (restart)"),
                       ("W_s", "W (background write)")):
        if key in src:
            out.print(f"{label} = {format_duration(inp[key])}  [dim]({src[key]})[/]")
    t = Table(title=f"Checkpoint interval and waste (rule: {inp['rule']})")
    t.add_column("")
    for s in doc["strategies"]:
        t.add_column(s["name"], justify="right")
    rows: list[tuple[str, Any]] = [
        ("C blocking / save", lambda s: format_duration(s["C_s"])),
        ("R restart", lambda s: format_duration(s["R_s"])),
        ("W write", lambda s: format_duration(s["W_s"]) if s["W_s"] else "—"),
        ("τ Young sqrt(2CM)", lambda s: format_duration(s["young_interval_s"])),
        ("τ Daly", lambda s: format_duration(s["daly_interval_s"])),
        ("C/τ  blocked", lambda s: pct(s["waste_parts"]["ckpt"])),
        ("τ/2M (+W/M)  rework", lambda s: pct(s["waste_parts"]["rework"])),
        ("R/M  restart", lambda s: pct(s["waste_parts"]["restart"])),
        ("[bold]waste[/]", lambda s: f"[bold]{pct(s['waste_fraction'])}[/]"),
        ("exact (exp. failures)", lambda s: pct(s["exact_waste_fraction"])),
        ("node-days / month", lambda s: "—" if s["waste_node_days_per_month"] is None
         else f"{s['waste_node_days_per_month']:.1f}"),
    ]
    for label, cell in rows:
        t.add_row(label, *(cell(s) for s in doc["strategies"]))
    out.print(t)
    out.print(f"checkpoint every [bold]{format_duration(doc['interval_s'])}[/] of training: "
              f"expected waste [bold]{pct(doc['waste_fraction'])}[/]")
    r = doc["resize"]
    if r is not None:
        out.print(f"{doc['strategies'][0]['name']} resized to {r['nodes']} nodes: "
                  f"M = {format_duration(r['job_mtbf_s'])}, "
                  f"τ = {format_duration(r['interval_s'])}, waste {pct(r['waste_fraction'])}, "
                  f"{r['waste_node_days_per_month']:.1f} node-days/month")
    for w in doc["warnings"]:
        out.print(f"[yellow]warning:[/] {w}")
    if plot is not None:
        out.print(f"plot written to {plot}")


def _plot(path: Path, doc: dict[str, Any]) -> None:
    M = doc["job_mtbf_s"]
    curves = []
    for s in doc["strategies"]:
        taus = [float(x) for x in np.geomspace(s["young_interval_s"] / 10,
                                               min(s["young_interval_s"] * 10, 2 * M), 200)]
        wastes = [planlib.waste(s["C_s"], t, M, s["R_s"], W=s["W_s"]).total for t in taus]
        curves.append(Curve(label=f"{s['name']} (C={format_duration(s['C_s'])}, "
                                  f"R={format_duration(s['R_s'])})", taus=taus, waste=wastes,
                            optimum=(s["interval_s"], s["waste_fraction"])))
    plot_waste(path, curves, title=f"Waste vs interval at M = {format_duration(M)}")
