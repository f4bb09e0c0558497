"""``tierckpt drill``: run the five resume drills against a training command, with a live
view of which drill is running; exit status 1 when any verdict fails (2 for bad input)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from tierckpt.cli._app import app
from tierckpt.cli._render import config_errors, console, emit_json
from tierckpt.drill import DRILLS, DrillConfig, Progress, run_drills

EXIT_FAILED = 1
"""Exit status when a drill's verdict fails."""

_STATE_STYLE = {"waiting": "dim", "running": "bold yellow", "passed": "green",
                "failed": "bold red", "skipped": "dim red"}


@app.command(context_settings={"allow_interspersed_args": False})
def drill(
    command: Annotated[list[str], typer.Argument(
        help="The training command, after --: python examples/train.py FLAGS... It must "
             "accept --tier1, --losses, --steps and --tier2 (docs/drills.md).")],
    nproc: Annotated[int, typer.Option(help="Ranks per node.")] = 2,
    nnodes: Annotated[int, typer.Option(help="Simulated nodes (torchrun agents) on loopback.")
    ] = 1,
    steps: Annotated[int, typer.Option(help="Training steps per run.")] = 20,
    seed: Annotated[int, typer.Option(help="Picks the step and rank to kill.")] = 0,
    tier2: Annotated[str | None, typer.Option(
        help="Tier-2 URL (s3://bucket/prefix or file:///path) (default: file://OUT/tier2).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for runs and reports.")] = Path(
        "drill-out"),
    rtol: Annotated[float | None, typer.Option(
        help="Loss tolerance for continuity (default: exact on CPU, 1e-2 on GPU).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report JSON.")] = False,
) -> None:
    """Kill a rank, check loss continuity, reshard, restore from tier 2 alone, report."""
    with config_errors():
        cfg = DrillConfig(command=tuple(command), nproc=nproc, nnodes=nnodes, steps=steps,
                          seed=seed, tier2=tier2, out=out, rtol=rtol)
        # with --json, stdout carries only the document: the live view goes to stderr
        con = Console(stderr=True, highlight=False) if as_json else console()
        with live_progress(con) as progress:
            doc = run_drills(cfg, progress)
    if as_json:
        emit_json(doc)
    else:
        con.print()
        con.print(summary_table(doc))
        con.print(f"report: {escape(doc['files']['md'])}  timeline: "
                  f"{escape(doc['files']['png'])}")
    if not doc["ok"]:
        raise typer.Exit(EXIT_FAILED)


@contextmanager
def live_progress(con: Console) -> Iterator[Progress]:
    """A rich live table of the drills (waiting, running, passed, failed) on ``con``;
    yields the ``progress`` callback for :func:`tierckpt.drill.run_drills`."""
    states: dict[str, tuple[str, str]] = {d: ("waiting", "") for d in (*DRILLS, "report")}
    with Live(_table(states), console=con, refresh_per_second=4, transient=False) as live:
        def progress(name: str, state: str, detail: str) -> None:
            states[name] = (state, detail)
            live.update(_table(states))

        yield progress


def _table(states: dict[str, tuple[str, str]]) -> Table:
    t = Table(title="tierckpt drill", title_justify="left")
    t.add_column("drill")
    t.add_column("state")
    t.add_column("detail", overflow="fold")
    for name, (state, detail) in states.items():
        style = _STATE_STYLE.get(state, "")
        t.add_row(name, f"[{style}]{state}[/]", escape(detail))
    return t


def summary_table(doc: dict[str, Any]) -> Table:
    """Measured C, W, R, tier-2 restore time and the verdicts of a report document."""
    t = Table(title="drill results", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    m = doc["measured"]
    for label, val in (("C (blocking per save)", m["C_s"]), ("W (background write)", m["W_s"]),
                       ("R (kill → first step)", m["R_s"]),
                       ("tier-2-only restore", doc.get("tier2_restore_s"))):
        t.add_row(label, "—" if val is None else f"{val:.3f} s")
    for name, ok in doc["verdicts"].items():
        t.add_row(f"{name} verdict", "[green]pass[/]" if ok else "[bold red]FAIL[/]")
    return t
