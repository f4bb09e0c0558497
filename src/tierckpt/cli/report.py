"""``tierckpt report --tier1 PATH | --events FILE``: a run's goodput from its own events,
across restarts.

Wall time split into productive training, blocked by saves (C), waiting for a previous
save, lost work, restart and start-up (:mod:`tierckpt.policy.goodput`); the failures, saves
and interval; the interruptions split into announced (a notice, and the emergency save
committed) and unannounced (failures), with the lost work and restart time of each kind;
the measured waste beside the model's prediction for the same C, R, τ, M. Under a scheduler
(Slurm, Kubernetes: ``process_start`` names the job) a table of the incarnations says which
requeue or restart of the job each one was, where it resumed and how it ended.
``--plot FILE`` draws the split as a stacked bar and the run's steps over time with its
failures and resumes. A line on the uploads to tier 2 follows: steps verified, failed
attempts, bytes, and the time the store's throttling cost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._render import config_errors, console, emit_json, pct
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.policy import goodput, uploads
from tierckpt.policy.units import format_bytes, format_duration, parse_duration
from tierckpt.runtime.events import read_events


@command()
def report(
    tier1: Annotated[Path | None, typer.Option(
        help="Tier-1 root: read its events.jsonl.")] = None,
    events: Annotated[Path | None, typer.Option(
        help="An events.jsonl file to read instead of a tier-1 root's.")] = None,
    node_mtbf: Annotated[str | None, typer.Option(
        help="Node MTBF for the model's prediction (e.g. 30d); default: the observed rate.")
    ] = None,
    nodes: Annotated[int, typer.Option(help="Nodes of the job (with --node-mtbf).")] = 1,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the split and the "
                                                   "timeline.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Where a run's wall time went, across restarts; goodput = productive ÷ wall.

    Reads the run's events from --tier1 PATH (its events.jsonl) or --events FILE."""
    with config_errors():
        path = events_file(tier1, events)
        mtbf = None if node_mtbf is None else parse_duration(node_mtbf, "--node-mtbf")
        records = read_events(path)
        g = goodput.account(records, node_mtbf_s=mtbf, nodes=nodes)
        up = uploads.summarize(records)
        if plot is not None:
            _plot(g, plot)
    if as_json:
        emit_json({**g.to_json(), "tier2_uploads": up.to_json()})
        return
    render(g, f"Goodput of {path}")
    if up.any:
        console().print(tier2_line(up))


def events_file(tier1: Path | None, events: Path | None) -> Path:
    """The event log to read: ``tier1/events.jsonl`` or ``events``, exactly one given."""
    if (tier1 is None) == (events is None):
        raise ConfigError("give the run as --tier1 PATH (a tier-1 root) or --events FILE "
                          "(an events.jsonl), one of them")
    if tier1 is not None:
        path = tier1 / layout.EVENTS
        if not path.is_file():
            raise ConfigError(f"--tier1: {str(tier1)!r} is not a tier-1 root with "
                              f"{layout.EVENTS} (an events file goes to --events)")
        return path
    assert events is not None
    if not events.is_file():
        raise ConfigError(f"--events: {str(events)!r} is not a file")
    return events


def render(g: goodput.Goodput, title: str) -> None:
    """Print the goodput table and its summary lines."""
    out = console()
    t = Table(title=title, title_justify="left")
    for col, just in (("where the time went", "left"), ("time", "right"), ("share", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for k in goodput.CATEGORIES:
        t.add_row(k.replace("_", " "), format_duration(g.seconds[k]),
                  pct(g.seconds[k] / g.wall_s if g.wall_s else 0.0))
    t.add_row("[bold]wall[/]", format_duration(g.wall_s), "100 %")
    out.print(t)
    out.print(f"goodput [bold]{pct(g.goodput)}[/]: {g.failures} failure(s), "
              f"{g.announced} announced preemption(s), {g.saves} saves"
              + (f", interval {format_duration(g.interval_s)}" if g.interval_s else ""))
    if g.interruptions:
        out.print(_interruptions(g))
    if any(i.scheduler for i in g.incarnations):
        out.print(_incarnations(g))
    if g.predicted_waste is not None:
        out.print(f"waste measured {pct(g.waste)}, the model predicts "
                  f"{pct(g.predicted_waste)} for C {format_duration(g.C_s or 0)}, R "
                  f"{format_duration(g.R_s or 0)}, M {format_duration(g.M_s or 0)}")


def tier2_line(up: uploads.Tier2Uploads) -> str:
    """One line on the uploads: steps verified on tier 2, failed attempts, bytes sent (and,
    when tier 2 already held some of what the steps refer to, how much), and what
    throttling cost (requests refused for their rate, seconds waited before resending)."""
    sent = format_bytes(up.bytes)
    if up.referenced > up.bytes:
        sent += (f" sent of {format_bytes(up.referenced)} referenced: "
                 f"{format_bytes(up.referenced - up.bytes)} already on tier 2")
    line = f"tier 2: {up.verified} upload(s) verified ({sent}), {up.failed} failed attempt(s); "
    if not up.throttled_requests:
        return line + "never throttled"
    return line + (f"throttled: {up.throttled_requests} request(s) refused for their rate, "
                   f"{format_duration(up.throttled_s)} waiting to send them again")


def _interruptions(g: goodput.Goodput) -> Table:
    """Per kind: how many, the work lost (steps and time) and the restart time."""
    t = Table(title="interruptions", title_justify="left", caption_justify="left",
              caption="announced: a notice came and the emergency save committed; "
                      "unannounced: failures")
    for col, just in (("kind", "left"), ("count", "right"), ("lost steps", "right"),
                      ("lost work", "right"), ("restart", "right"),
                      ("restart each", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for kind, row in g.by_kind().items():
        n = int(row["count"])
        t.add_row(kind, str(n), str(int(row["lost_steps"])), format_duration(row["lost_work_s"]),
                  format_duration(row["restart_s"]),
                  format_duration(row["restart_s"] / n) if n else "—")
    return t


def _incarnations(g: goodput.Goodput) -> Table:
    """One row per incarnation: its job and requeue under the scheduler, torchrun's restart,
    the step it resumed from, the steps it trained and how it ended (the kinds of the
    interruptions table; "—" for the last, which did not end in an interruption)."""
    t = Table(title="incarnations", title_justify="left", caption_justify="left",
              caption="requeue: the scheduler's runs of the job before this one (Slurm "
                      "requeues, JobSet restarts); restart: torchrun's inside one run; "
                      "resumed: the step restored")
    for col, just in (("started", "right"), ("job", "left"), ("requeue", "right"),
                      ("restart", "right"), ("resumed", "right"), ("steps", "right"),
                      ("ended", "left")):
        t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    t0 = g.incarnations[0].start
    for n, inc in enumerate(g.incarnations):
        last = n + 1 == len(g.incarnations)
        ended = "announced" if inc.announced else "—" if last else "unannounced"
        steps = ("—" if inc.first_step is None
                 else f"{inc.first_step}–{inc.last_step}")
        t.add_row("+" + format_duration(inc.start - t0),
                  f"{inc.scheduler} {inc.job_id or '?'}" if inc.scheduler else "—",
                  _opt(inc.requeue), _opt(inc.restart_count),
                  "fresh" if inc.resumed_from is None else str(inc.resumed_from),
                  steps, ended)
    return t


def _opt(x: int | None) -> str:
    return "—" if x is None else str(x)


def _plot(g: goodput.Goodput, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: install tierckpt[plot]") from None
    fig, (bar, line) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(1, 3))
    try:
        bottom = 0.0
        for k in goodput.CATEGORIES:
            share = 100 * g.seconds[k] / g.wall_s if g.wall_s else 0.0
            bar.bar(0, share, bottom=bottom, label=k.replace("_", " "))
            bottom += share
        bar.set_xticks([])
        bar.set_ylabel("% of wall time")
        bar.legend(fontsize=7)
        t0 = g.incarnations[0].start if g.incarnations else 0.0
        for inc in g.incarnations:
            if inc.first_step_t is not None and inc.first_step is not None:
                line.plot([(inc.first_step_t - t0) / 60, (inc.end - t0) / 60],
                          [inc.first_step, inc.last_step or inc.first_step], "-o", ms=3)
            if inc.failure_t is not None:
                line.axvline((inc.failure_t - t0) / 60, color="red", alpha=0.5)
            if inc.announced and inc.stop_t is not None:
                line.axvline((inc.stop_t - t0) / 60, color="orange", alpha=0.7)
        line.set_xlabel("minutes since the run started")
        line.set_ylabel("step")
        line.set_title("steps per incarnation (red: failure detected; orange: preempted, "
                       "saved)")
        try:
            fig.savefig(path, dpi=110, bbox_inches="tight")
        except OSError as e:
            raise ConfigError(f"--plot: cannot write {str(path)!r}: {e}") from None
    finally:
        plt.close(fig)
