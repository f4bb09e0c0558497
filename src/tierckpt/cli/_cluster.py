"""``tierckpt doctor --cluster``: gather the launch's facts, judge them against the measured
emergency save (:mod:`tierckpt.launch.cluster`), and print each check with what to fix.
Exit 1 when a check failed.

Each check is a block of lines, not a table row: a fix is a command or a line to paste,
and it is printed whole at any terminal width (the terminal wraps it; nothing is cut)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.markup import escape

from tierckpt.cli._render import config_errors, console, emit_json
from tierckpt.cli._tiers import EXIT_FAILED
from tierckpt.launch import cluster, timing

_MARK = {True: "[green]ok     [/]", False: "[red]FIX    [/]", None: "[yellow]unknown[/]"}


def doctor_cluster(*, tier1: Path | None, script: Path | None, as_json: bool) -> None:
    """Run the cluster checks and render them; exit 1 when one failed."""
    with config_errors():
        save = timing.save_time(timing.read_root(tier1)) if tier1 is not None else None
        facts = cluster.gather(script=script)
        checks = cluster.checks(facts, save)
    failed = any(c.ok is False for c in checks)
    if as_json:
        emit_json({"scheduler": facts.scheduler, "facts": dataclasses.asdict(facts),
                   "emergency_save_s": save.seconds if save else None,
                   "checks": [dataclasses.asdict(c) for c in checks], "ok": not failed})
    else:
        out = console()
        out.print(f"[bold]the launch[/] ({facts.scheduler or 'no scheduler found'})",
                  soft_wrap=True)
        for c in checks:
            out.print(f"{_MARK[c.ok]} [bold]{escape(c.name)}[/]", soft_wrap=True)
            out.print(f"        found: {escape(c.detail)}", soft_wrap=True)
            if c.fix:
                out.print(f"        fix:   {escape(c.fix)}", soft_wrap=True)
        out.print("[red]fix the checks marked FIX[/]" if failed else "[green]nothing to fix[/]")
    if failed:
        raise typer.Exit(EXIT_FAILED)
