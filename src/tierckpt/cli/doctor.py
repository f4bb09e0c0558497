"""``tierckpt doctor --tier2 URL``: what a tier-2 server supports and what tierckpt does about it;
``tierckpt doctor --cluster``: whether this job's launch lets a notice end in a saved
checkpoint (:mod:`tierckpt.cli._cluster`).

Runs the same probe a job runs when it starts (:func:`tierckpt.tier2.probe.probe_url`, on
scratch keys under the prefix, removed afterwards) and prints one row per feature: whether
the server supports it (a feature the server answered "not supported", HTTP 501, shows as
no), and what tierckpt does with it — then the integrity, marker and upload modes chosen.
Exit 0 when the server can be used, 1 when it cannot (no integrity mode), 2 for a
configuration error (missing bucket, refused credentials, a bad URL).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._cluster import doctor_cluster
from tierckpt.cli._render import EXIT_CONFIG, console, emit_json
from tierckpt.cli._tiers import EXIT_FAILED, failures
from tierckpt.tier2.capabilities import TABLE
from tierckpt.tier2.probe import ProbeResult, probe_url
from tierckpt.tier2.storage.url import FORMS

_MARK = {True: "[green]yes[/]", False: "[red]no[/]", None: "[dim]not tried[/]"}


@command()
def doctor(
    tier2: Annotated[str | None, typer.Option(
        help=f"Tier 2 to probe: {FORMS}.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
    cluster: Annotated[bool, typer.Option(
        "--cluster", help="Check the launch instead: torchrun's signals and shutdown "
        "timeout, the scheduler's lead or grace, Slurm's --requeue.")] = False,
    tier1: Annotated[Path | None, typer.Option(
        "--tier1", help="With --cluster: a tier-1 root whose events measure the emergency "
        "save.")] = None,
    script: Annotated[Path | None, typer.Option(
        help="With --cluster: an sbatch script or Kubernetes manifest to check.")] = None,
) -> None:
    """Probe the tier-2 server at --tier2 (integrity, marker and upload modes), or with
    --cluster check that this job's launch lets a notice end in a saved checkpoint.

    --tier2 runs the probe a job runs at start (scratch keys under the prefix, removed
    afterwards). Exit 0 when all is well, 1 when something must be fixed (no integrity mode;
    a failed cluster check), 2 for a configuration error."""
    if cluster:
        doctor_cluster(tier1=tier1, script=script, as_json=as_json)
        return
    if tier2 is None:
        typer.echo("tierckpt doctor: give --tier2 URL (probe tier 2) or --cluster (check the "
                   "launch)", err=True)
        raise typer.Exit(EXIT_CONFIG)
    with failures():
        result = probe_url(tier2)
    if as_json:
        emit_json(_doc(result))
    else:
        _render(result)
    if result.modes.integrity is None:
        raise typer.Exit(EXIT_FAILED)


def _doc(r: ProbeResult) -> dict[str, Any]:
    return {**r.to_json(), "features": [
        {"feature": feature, "field": field, "supported": getattr(r.capabilities, field),
         "use": use} for field, feature, use in TABLE]}


def _render(r: ProbeResult) -> None:
    out = console()
    t = Table(title=f"{r.url} ({r.capabilities.server})")
    for col in ("feature", "supported", "what tierckpt does with it"):
        t.add_column(col)
    for field, feature, use in TABLE:
        t.add_row(feature, _MARK[getattr(r.capabilities, field)], use)
    out.print(t)
    m = r.modes
    if m.integrity is None:
        out.print("[bold red]unusable[/]: no integrity mode tierckpt can trust; "
                  + "; ".join(r.capabilities.notes))
        return
    out.print(f"integrity: [bold]{m.integrity.value}[/]   marker: [bold]{m.marker.value}[/]"
              f"   upload: [bold]{m.upload.value}[/]")
    for w in m.weaker:
        out.print(f"[yellow]weaker[/]: {w}")
    for n in r.capabilities.notes:
        out.print(f"[dim]note: {n}[/]")
