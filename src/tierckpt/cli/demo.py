"""``make demo`` (``python -m tierckpt.cli.demo``): the drills on the reference trainer,
then the plan.

Runs :func:`tierckpt.drill.run_drills` on ``examples/train.py`` with 2 ranks on CPU and the
embedded ``file://`` tier 2, into ``./demo-out`` (a few minutes on 2 cores), and ends with
one table: measured C, W and R (the killed rank restores from tier 0, node RAM), the
continuity and reshard verdicts, the tier-2-only restore time, and the checkpoint interval
``tierckpt.policy.plan`` recommends for a stated cluster (64 nodes, node MTBF 32 days) from
the measured C, W and R. Exit status 1 when a drill fails.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tierckpt.cli import report
from tierckpt.cli._extras import is_torch, torch_missing
from tierckpt.cli._render import console, pct
from tierckpt.cli.drill import live_progress
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.policy import goodput
from tierckpt.policy import plan as planlib
from tierckpt.policy.units import format_duration
from tierckpt.runtime.events import read_events
from tierckpt.tier0.root import BASE_ENV

__all__ = ["CLUSTER_NODES", "NODE_MTBF_S", "TRAIN_FLAGS", "commands_to_paste", "demo_plan", "main",
           "print_commands", "result_table"]

CLUSTER_NODES = 64
NODE_MTBF_S = 32 * 86400.0
"""The stated cluster: 64 nodes, each failing once in 32 days on average (job MTBF 12 h)."""
TRAIN_FLAGS = ("--layers", "2", "--dim", "64", "--samples", "1024", "--save-every", "4",
               "--timeout", "60", "--tier0", "auto")
"""The example's flags for the demo: its default small GPT, a save every 4 steps, tier 0
in RAM (a killed rank restores from it)."""
STEPS = 16

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train.py"  # src/tierckpt/cli/


def demo_plan(measured: Mapping[str, float | None], *, nodes: int = CLUSTER_NODES,
              node_mtbf_s: float = NODE_MTBF_S) -> planlib.IntervalPlan | None:
    """Young's interval and its waste for the cluster from measured C, W and R (None if C
    was not measured)."""
    c = measured.get("C_s")
    if c is None or c <= 0:
        return None
    return planlib.plan_interval(c, planlib.job_mtbf(node_mtbf_s, nodes),
                                 measured.get("R_s") or 0.0, W=measured.get("W_s") or 0.0,
                                 name="measured")


def _s(x: object) -> str:
    if not isinstance(x, (int, float)):
        return "—"
    return f"{1000 * x:.0f} ms" if x < 1 else format_duration(float(x))


def result_table(doc: Mapping[str, Any], p: planlib.IntervalPlan | None) -> Table:
    """The demo's closing table."""
    m, v, drills = doc["measured"], doc["verdicts"], doc["drills"]
    t = Table(title="tierckpt demo: measured on this machine, planned for a cluster",
              title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("how", overflow="fold")
    t.add_row("C", _s(m["C_s"]), "training blocked per save (median, slowest rank)")
    t.add_row("W", _s(m["W_s"]), "background write until committed (median)")
    t.add_row("R", _s(m["R_s"]), "SIGKILL of a rank → first step after torchrun's restart")
    verdict = {True: "[green]pass[/]", False: "[bold red]FAIL[/]"}
    t.add_row("kill", verdict[v["kill"]], drills.get("kill", {}).get("summary", ""))
    t.add_row("continuity", verdict[v["continuity"]],
              drills.get("continuity", {}).get("summary", ""))
    t.add_row("reshard", verdict[v["reshard"]], drills.get("reshard", {}).get("summary", ""))
    t.add_row("tier-2-only restore", _s(doc.get("tier2_restore_s")),
              f"{'pass' if v['tier2'] else 'FAIL'}: every tier-1 root wiped first")
    if p is not None:
        t.add_row("recommended interval", _s(p.interval_s),
                  f"Young, {CLUSTER_NODES} nodes × node MTBF {format_duration(NODE_MTBF_S)} "
                  f"(job MTBF {format_duration(p.M)}); expected waste "
                  f"{pct(p.waste.total)}")
    return t


def commands_to_paste(drill_json: str | Path, kill_events: Path | None) -> list[tuple[str, str]]:
    """The demo's closing suggestions as ``(what, command line)`` pairs: the plan from the
    measured drill, and the kill drill's goodput report when its event log exists."""
    out = [("Plan it yourself", f"tierckpt plan --from-drill {shlex.quote(str(drill_json))} "
                                f"--node-mtbf 32d --nodes {CLUSTER_NODES}")]
    if kill_events is not None:
        out.append(("The kill drill's goodput",
                    f"tierckpt report --tier1 {shlex.quote(str(kill_events.parent))}"))
    return out


def print_commands(con: Console, commands: Sequence[tuple[str, str]]) -> None:
    """Print each command on a line of its own, never wrapped (``soft_wrap``: a narrow
    terminal folds it visually, but a copy still pastes one line) and never read as rich
    markup (a path may hold brackets)."""
    for what, line in commands:
        con.print(f"{what}:", markup=False, highlight=False)
        con.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every drill passed."""
    ap = argparse.ArgumentParser(prog="python -m tierckpt.cli.demo", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("demo-out"))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    con = console()
    try:  # torch, for the drills only: importing this module (bench/tier0.py does) needs none
        from tierckpt.drill import DrillConfig, run_drills
    except ImportError as e:
        if not is_torch(e):
            raise
        con.print(f"[red]error:[/] {torch_missing('the demo')}")
        return 2
    if not EXAMPLE.is_file():
        con.print(f"[red]error:[/] {EXAMPLE} not found: run the demo from a source checkout")
        return 2
    try:
        cfg = DrillConfig(command=(sys.executable, str(EXAMPLE), *TRAIN_FLAGS), out=a.out,
                          steps=a.steps, seed=a.seed, nproc=2)
    except ConfigError as e:
        con.print(f"[red]error:[/] {e}")
        return 2
    con.print(f"Drilling examples/train.py: 2 ranks on CPU, {a.steps} steps per run, "
              f"tier 2 = {cfg.tier2}, output in {cfg.out}")
    ram = Path(tempfile.mkdtemp(prefix="tierckpt-demo-", dir=_shm()))
    os.environ[BASE_ENV] = str(ram)  # the runs' tier 0, removed when the demo ends
    try:
        with live_progress(con) as progress:
            doc = run_drills(cfg, progress)
    except ConfigError as e:
        con.print(f"[red]error:[/] {e}")
        return 2
    finally:
        shutil.rmtree(ram, ignore_errors=True)
    con.print()
    con.print(result_table(doc, demo_plan(doc["measured"])))
    kill_events = cfg.roots("kill")[0] / layout.EVENTS
    if kill_events.is_file():  # the goodput of the killed-and-resumed run, from its events
        report.render(goodput.account(read_events(kill_events)),
                      "Goodput of the kill drill's run")
    con.print(f"Report: {doc['files']['md']}  timeline: {doc['files']['png']}", soft_wrap=True)
    print_commands(con, commands_to_paste(doc["files"]["json"],
                                          kill_events if kill_events.is_file() else None))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
