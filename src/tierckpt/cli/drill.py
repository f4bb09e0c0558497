"""``tierckpt drill``: run the five resume drills against a training command, with a live
view of which drill is running; exit status 1 when any verdict fails (2 for bad input).
``--chaos N`` runs the chaos drill instead: N seeded fault cycles, exit 1 on any violated
invariant. ``--preempt`` runs the preemption drill: a notice at a seeded step, every rank
stopped at one step, nothing lost (with ``--chaos``: the notice faults join the chaos
catalogue)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._extras import needs_torch
from tierckpt.cli._render import config_errors, console, emit_json
from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.url import FORMS

if TYPE_CHECKING:  # tierckpt.drill imports torch: imported by the command when it runs
    from tierckpt.drill import Progress

EXIT_FAILED = 1
"""Exit status when a drill's verdict fails."""

_STATE_STYLE = {"waiting": "dim", "running": "bold yellow", "passed": "green",
                "done": "green", "failed": "bold red", "skipped": "dim red"}


# drill's options, each with its help; the flag is the parameter's name (--preempt-rank).
_Command = Annotated[list[str], typer.Argument(
    help="The training command, after --: python examples/train.py FLAGS... It must "
         "accept --tier1, --losses, --steps and --tier2 (docs/drills.md).")]
_Nproc = Annotated[int | None, typer.Option(
    help="Ranks per node (default 2; with --chaos 1; with --heal 3).")]
_Nnodes = Annotated[int | None, typer.Option(
    help="Simulated nodes (torchrun agents) on loopback (default 1; with --chaos 2, "
         "with --chaos --heal 1). With --heal and 2 or more: the node-loss heal drill "
         "(docs/heal.md).")]
_Steps = Annotated[int | None, typer.Option(
    help="Training steps per run (default 20; with --chaos 150 per cycle).")]
_Seed = Annotated[int, typer.Option(
    help="Picks the step and rank to kill (with --chaos: every cycle's faults).")]
_Chaos = Annotated[int | None, typer.Option(
    help="Run the chaos drill instead: this many seeded fault cycles on one job "
         "(docs/drills.md, 'Chaos drill').")]
_Tier2 = Annotated[str | None, typer.Option(
    help=f"Tier-2 URL ({FORMS}; default: file://OUT/tier2).")]
_Out = Annotated[Path, typer.Option(help="Directory for runs and reports.")]
_Rtol = Annotated[float | None, typer.Option(
    help="Loss tolerance for continuity (default: exact on CPU, 1e-2 on GPU).")]
_Tier0 = Annotated[str | None, typer.Option(
    help="With --chaos: run the job with tier 0 and its RAM faults: 'auto' (Tier0()) or "
         "a directory on tmpfs; passed to the command as --tier0 (default: the command's "
         "own --tier0, else none).")]
_Preempt = Annotated[bool, typer.Option(
    "--preempt", help="Run the preemption drill instead: a notice (SIGTERM to the "
    "launcher) at a seeded step; every rank must stop at one step and lose nothing. With "
    "--chaos: add the notice faults to the chaos catalogue (docs/drills.md).")]
_PreemptRank = Annotated[int | None, typer.Option(
    help="With --preempt: send SIGUSR1 to this rank's worker only, not SIGTERM to the "
         "launcher.")]
_Kinds = Annotated[str | None, typer.Option(
    help="With --chaos: draw only these fault kinds, comma-separated (default: the whole "
         "catalogue that can be injected here). With --heal: these heal faults, in order "
         "(default: mid_step, two_at_once, mid_save, replacement, mid_heal).")]
_Heal = Annotated[bool, typer.Option(
    "--heal", help="Run the heal drill instead: the command under `tierckpt run --heal` "
    "(default 3 ranks, 120 steps), a seeded series of rank deaths; each must end in a "
    "heal (or, when it must, a full restart) that changes no loss (docs/heal.md). With "
    "--chaos: the chaos job runs on one node under `tierckpt run` and heal_kill joins "
    "its catalogue (docs/drills.md).")]
_Dedup = Annotated[bool, typer.Option(
    "--dedup", help="With --chaos: add the faults of tier 2's content objects (a damaged or "
    "missing object, a deletion cut short; a file:// tier 2) and check every tier-2 step "
    "at rest (docs/drills.md).")]
_Etcd = Annotated[str | None, typer.Option(
    help="With --heal --nnodes N: the job's etcd, etcd://host:port (default: a private one "
         "the drill starts from the etcd on PATH).", show_default=False)]
_AsJson = Annotated[bool, typer.Option("--json", help="Print the report JSON.")]


@command(context_settings={"allow_interspersed_args": False})
def drill(
    command: _Command,
    nproc: _Nproc = None,
    nnodes: _Nnodes = None,
    steps: _Steps = None,
    seed: _Seed = 0,
    chaos: _Chaos = None,
    tier2: _Tier2 = None,
    out: _Out = Path("drill-out"),
    rtol: _Rtol = None,
    tier0: _Tier0 = None,
    preempt: _Preempt = False,
    preempt_rank: _PreemptRank = None,
    kinds: _Kinds = None,
    heal: _Heal = False,
    dedup: _Dedup = False,
    etcd: _Etcd = None,
    as_json: _AsJson = False,
) -> None:
    """Kill a rank, check loss continuity, reshard, restore from tier 2 alone, report.

    With --chaos N: N seeded fault cycles on one job instead, exit 1 on any violated
    invariant. With --preempt: a termination notice at a seeded step instead, exit 1 unless
    every rank stopped at one step, lost nothing and continued bit for bit. With --heal: rank
    deaths under `tierckpt run --heal` instead, exit 1 unless each healed (or fell back to a
    full restart where it must) and every loss is unchanged. Needs PyTorch."""
    f = _Flags(command=tuple(command), nproc=nproc, nnodes=nnodes, steps=steps, seed=seed,
               chaos=chaos, tier2=tier2, out=out, rtol=rtol, tier0=tier0, preempt=preempt,
               preempt_rank=preempt_rank, kinds=kinds, heal=heal, dedup=dedup, etcd=etcd)
    if etcd is not None and not (heal and chaos is None and (nnodes or 1) >= 2):
        with config_errors():
            raise ConfigError("--etcd is for the node-loss heal drill: add --heal and "
                              "--nnodes 2 (or more), without --chaos")
    pick = (_heal_drill if heal and chaos is None else _chaos_drill if chaos is not None
            else _preempt_drill if preempt else _resume_drills)
    with needs_torch("drill"):
        mode = pick(f)
    _run_and_render(*mode, as_json=as_json)


@dataclasses.dataclass(frozen=True)
class _Flags:
    """The command's flags as given (None: the chosen drill's default)."""

    command: tuple[str, ...]
    nproc: int | None
    nnodes: int | None
    steps: int | None
    seed: int
    chaos: int | None
    tier2: str | None
    out: Path
    rtol: float | None
    tier0: str | None
    preempt: bool
    preempt_rank: int | None
    kinds: str | None
    heal: bool
    dedup: bool
    etcd: str | None

    def kind_list(self) -> tuple[str, ...] | None:
        """``--kinds`` split on commas (None: not given)."""
        if self.kinds is None:
            return None
        return tuple(k.strip() for k in self.kinds.split(",") if k.strip())


_Mode = tuple[Callable[["Progress"], dict[str, Any]], tuple[str, ...],
              Callable[[dict[str, Any]], Table], tuple[tuple[str, str], ...]]
"""A drill to run: its runner, its stages, its table and the report files it names."""


def _heal_drill(f: _Flags) -> _Mode:
    """``--heal`` (without ``--chaos``): rank deaths under ``tierckpt run --heal``."""
    from tierckpt.drill.heal import HEAL_FAULTS, HEAL_STAGES, HealDrillConfig, run_heal

    if f.nnodes not in (None, 1):
        return _heal_nodes_drill(f)

    def run(progress: Progress) -> dict[str, Any]:
        if f.preempt or f.tier0 is not None or f.etcd is not None:
            raise ConfigError("--heal on one node: drop --preempt, --tier0 and --etcd (or "
                              "give --nnodes 2 or more for the node-loss drill)")
        cfg = HealDrillConfig(command=f.command, nproc=3 if f.nproc is None else f.nproc,
                              steps=120 if f.steps is None else f.steps, seed=f.seed,
                              faults=tuple(HEAL_FAULTS) if (k := f.kind_list()) is None
                              else k, out=f.out)
        return run_heal(cfg, progress)
    return run, (*HEAL_STAGES, "report"), heal_table, (("report", "report"),)


def _heal_nodes_drill(f: _Flags) -> _Mode:
    """``--heal --nnodes N`` (N >= 2): node losses under ``tierckpt run --nnodes``."""
    from tierckpt.drill.heal_nodes import (
        NODE_FAULTS,
        NODE_STAGES,
        NodeDrillConfig,
        run_heal_nodes,
    )

    def run(progress: Progress) -> dict[str, Any]:
        if f.preempt or f.tier0 is not None or f.rtol is not None:
            raise ConfigError("--heal --nnodes: drop --preempt, --tier0 and --rtol")
        nnodes = f.nnodes or 2
        faults = k if (k := f.kind_list()) is not None else tuple(  # every one that applies
            n for n in NODE_FAULTS if not (n == "store_node" and f.etcd is not None)
            and not (n == "two_nodes" and nnodes < 3))
        cfg = NodeDrillConfig(command=f.command, nnodes=nnodes,
                              nproc=1 if f.nproc is None else f.nproc,
                              steps=max(80, 15 * (len(faults) + 1)) if f.steps is None
                              else f.steps, seed=f.seed, faults=faults,
                              etcd=f.etcd, tier2=f.tier2, out=f.out)
        return run_heal_nodes(cfg, progress)
    return run, (*NODE_STAGES, "report"), heal_table, (("report", "report"),)


def _chaos_drill(f: _Flags) -> _Mode:
    """``--chaos N``: seeded fault cycles on one job (with ``--heal``, under the heal
    launcher; with ``--preempt``, the notice faults too)."""
    from tierckpt.drill.chaos import STAGES, ChaosConfig, run_chaos

    def run(progress: Progress) -> dict[str, Any]:
        if f.preempt_rank is not None:
            raise ConfigError("--preempt-rank is a preemption drill option: give --preempt "
                              "without --chaos")
        kinds = f.kind_list()
        more: dict[str, Any] = {} if kinds is None else {"kinds": kinds}
        assert f.chaos is not None
        cfg = ChaosConfig(command=f.command, cycles=f.chaos,
                          nproc=(3 if f.heal else 1) if f.nproc is None else f.nproc,
                          nnodes=(1 if f.heal else 2) if f.nnodes is None else f.nnodes,
                          steps=f.steps, seed=f.seed, tier2=f.tier2, out=f.out, rtol=f.rtol,
                          tier0=f.tier0, preempt=f.preempt, heal=f.heal, dedup=f.dedup,
                          **more)
        return run_chaos(cfg, progress)
    return run, (*STAGES, "report"), chaos_table, (("report", "md"),)


def _preempt_drill(f: _Flags) -> _Mode:
    """``--preempt``: a termination notice at a seeded step."""
    from tierckpt.drill.preempt import PREEMPT_STAGES, PreemptConfig, run_preempt

    def run(progress: Progress) -> dict[str, Any]:
        if f.tier0 is not None or f.kinds is not None or f.dedup:
            raise ConfigError("--tier0, --kinds and --dedup are chaos drill options: give "
                              "--chaos N")
        cfg = PreemptConfig(command=f.command, nproc=2 if f.nproc is None else f.nproc,
                            nnodes=1 if f.nnodes is None else f.nnodes,
                            steps=20 if f.steps is None else f.steps, seed=f.seed,
                            rank=f.preempt_rank, tier2=f.tier2, out=f.out, rtol=f.rtol)
        return run_preempt(cfg, progress)
    return run, (*PREEMPT_STAGES, "report"), preempt_table, (("report", "md"),)


def _resume_drills(f: _Flags) -> _Mode:
    """No mode flag: the five resume drills."""
    from tierckpt.drill import DRILLS, DrillConfig, run_drills

    def run(progress: Progress) -> dict[str, Any]:
        if f.tier0 is not None or f.kinds is not None or f.dedup:
            raise ConfigError("--tier0, --kinds and --dedup are chaos drill options: give "
                              "--chaos N")
        if f.preempt_rank is not None:
            raise ConfigError("--preempt-rank is a preemption drill option: give --preempt")
        cfg = DrillConfig(command=f.command, nproc=2 if f.nproc is None else f.nproc,
                          nnodes=1 if f.nnodes is None else f.nnodes,
                          steps=20 if f.steps is None else f.steps, seed=f.seed,
                          tier2=f.tier2, out=f.out, rtol=f.rtol)
        return run_drills(cfg, progress)
    return run, (*DRILLS, "report"), summary_table, (("report", "md"), ("timeline", "png"))


def _run_and_render(run: Callable[[Progress], dict[str, Any]], stages: tuple[str, ...],
                    table: Callable[[dict[str, Any]], Table],
                    files: Sequence[tuple[str, str]], *, as_json: bool) -> None:
    """Run a drill under the live view (on stderr with --json, so stdout carries only the
    document), then print its JSON or its table and report files; exit 1 unless it passed.
    A ConfigError (bad arguments) exits 2."""
    with config_errors():
        con = Console(stderr=True, highlight=False) if as_json else console()
        with live_progress(con, stages) as progress:
            doc = run(progress)
    if as_json:
        emit_json(doc)
    else:
        con.print()
        con.print(table(doc))
        con.print("  ".join(f"{label}: {escape(doc['files'][key])}" for label, key in files))
    if not doc["ok"]:
        raise typer.Exit(EXIT_FAILED)


def heal_table(doc: dict[str, Any]) -> Table:
    """Per fault: where, how it ended, R; then the heal drill's verdicts."""
    t = Table(title="heal drill results", title_justify="left")
    for col in ("fault / verdict", "at step", "outcome", "R (s)", "ok"):
        t.add_column(col)
    for f in doc["faults"]:
        r = f.get("R_s")
        t.add_row(f["kind"], str(f.get("at_step", "—")), f["outcome"],
                  "—" if r is None else f"{r:.2f}", "yes" if f["ok"] else "NO")
    for name, v in doc["verdicts"].items():
        t.add_row(name, "", escape(v["detail"]), "", "yes" if v["ok"] else "NO")
    return t


def chaos_table(doc: dict[str, Any]) -> Table:
    """Per fault kind: cycles passed and violated; then the chaos report's totals."""
    t = Table(title="chaos drill results", title_justify="left")
    t.add_column("fault kind / total")
    t.add_column("value", justify="right")
    for kind, k in doc["by_kind"].items():
        style = "green" if not k["violated"] else "bold red"
        t.add_row(kind, f"[{style}]{k['passed']} passed, {k['violated']} violated[/]")
    tot = doc["totals"]
    t.add_row("cycles", f"{tot['cycles']}/{tot['cycles_planned']}")
    t.add_row("faults fired", str(tot["faults"]))
    t.add_row("restarts", str(tot["restarts"]))
    t.add_row("violations", ("[green]0[/]" if not tot["violations"] else
                             f"[bold red]{tot['violations']}[/]"))
    bound = "—" if tot["tier1_bound"] is None else str(tot["tier1_bound"])
    t.add_row("tier-1 peak / bound", f"{tot['tier1_peak']} / {bound}")
    t.add_row("wall time", f"{tot['wall_s']:.0f} s")
    if doc.get("error"):
        t.add_row("stopped early", f"[bold red]{escape(str(doc['error'])[:200])}[/]")
    return t


def preempt_table(doc: dict[str, Any]) -> Table:
    """The notice, the agreed step, the measured times and the preemption verdicts."""
    from tierckpt.drill.preempt_report import timing_rows

    t = Table(title="preemption drill results", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right", overflow="fold")
    n = doc.get("notice")
    if n:
        t.add_row("notice", f"{n['signal']} to the {n['target']} after step {n['seen']}")
        t.add_row("every rank stopped after step", str(doc.get("stop_step")))
        t.add_row("steps lost / trained after the notice",
                  f"{doc.get('lost_steps')} / {doc.get('steps_after_notice')}")
        for label, value in timing_rows(doc):
            t.add_row(label, escape(value))
    for name, ok in doc["verdicts"].items():
        t.add_row(f"{name} verdict", "[green]pass[/]" if ok else "[bold red]FAIL[/]")
    if doc.get("error"):
        t.add_row("stopped early", f"[bold red]{escape(str(doc['error'])[:200])}[/]")
    return t


@contextmanager
def live_progress(con: Console, stages: tuple[str, ...] | None = None) -> Iterator[Progress]:
    """A rich live table of the drills (waiting, running, passed, failed) on ``con``;
    yields the ``progress`` callback for :func:`tierckpt.drill.run_drills` (or, with the
    chaos drill's ``stages``, :func:`tierckpt.drill.chaos.run_chaos`). ``stages`` defaults
    to the five drills and the report."""
    if stages is None:
        from tierckpt.drill import DRILLS

        stages = (*DRILLS, "report")
    states: dict[str, tuple[str, str]] = {d: ("waiting", "") for d in stages}
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
        style = _STATE_STYLE.get(state)
        t.add_row(name, f"[{style}]{escape(state)}[/]" if style else escape(state),
                  escape(detail))
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
