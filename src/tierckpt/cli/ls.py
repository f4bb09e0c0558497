"""``tierckpt ls``: every checkpoint on tier 1 (tier 0 where this node sees it, and tier 2)
with its state, size and age, and the tier-2 modes the job recorded on tier 1 (integrity,
marker, upload)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._render import console, emit_json
from tierckpt.cli._tiers import age, failures, tier1_dir, tier2
from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.format import layout
from tierckpt.ops import inventory
from tierckpt.policy.units import format_bytes
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2 import probe
from tierckpt.tier2.storage.url import FORMS

_STYLE = {"partial": "yellow", "invalid": "bold red", "complete": "cyan",
          "uploading": "magenta", "upload_failed": "bold red", "verified": "green",
          "conflict": "bold red"}


@command()
def ls(
    tier1: Annotated[Path, typer.Option(help="Tier-1 root (the job's tier1 directory).")],
    tier2_url: Annotated[str | None, typer.Option(
        "--tier2", help=f"Tier 2 as {FORMS} (also list it).")] = None,
    tier0: Annotated[Path | None, typer.Option(
        help="The job's Tier0(path) directory, when it named one (a Tier0() job's tier 0 is "
             "found from --tier1).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
) -> None:
    """List every checkpoint on tier 1 (and tier 2) with its state, size and age.

    Tier 0 (node RAM) is listed too when this node holds the job's tier-0 root. States:
    complete, partial, uploading, upload failed, verified, invalid, conflict; pinned
    checkpoints name their holders. Below the table: the tier-2 modes the job recorded and
    what its upload cadence copies next. A
    tier 2 that cannot be listed does not hide tier 1: its rows are shown, then the error
    (exit status 1)."""
    root = tier1_dir(tier1)
    with failures():
        ram = inventory.tier0_root(root, tier0)
    entries, t2_error = _entries(root, tier2_url, ram)
    modes = probe.recorded(Tier1Catalog(root))
    cadence = inventory.upload_cadence(root)
    if as_json:
        emit_json({"tier1": str(root), "tier0": None if ram is None else str(ram),
                   "tier2": tier2_url,
                   "checkpoints": [e.to_json() for e in entries],
                   "tier2_modes": _modes_json(modes), "tier2_error": t2_error,
                   "upload_cadence": None if cadence is None else cadence.to_json()})
        if t2_error is not None:
            raise typer.Exit(1)
        return
    out = console()
    if not entries:
        out.print(f"no checkpoints in {root}" + (f" or {tier2_url}" if tier2_url and
                                                 t2_error is None else ""))
        _print_modes(modes)
        _tier2_failed(tier2_url, t2_error)
        return
    where = [str(root), *([] if ram is None else [f"{ram} (tier 0)"]),
             *([tier2_url] if tier2_url else [])]
    t = Table(title=f"Checkpoints in {', '.join(where[:-1])}"
                    f"{' and ' if len(where) > 1 else ''}{where[-1]}")
    for col, just in (("step", "right"), ("tier", "right"), ("state", "left"),
                      ("pinned", "left"), ("size", "right"), ("age", "right"),
                      ("integrity", "left"), ("detail", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for e in entries:
        name = str(e.step) if e.name == layout.step_dirname(e.step) else e.name
        style = _STYLE.get(e.state, "")
        state = e.state.replace("_", " ")  # "upload failed"
        t.add_row(name, str(e.tier), f"[{style}]{state}[/]" if style else state,
                  ", ".join(e.pinned_by), _size(e), age(e.age_s),
                  e.integrity or "", e.detail or "")
    out.print(t)
    _print_modes(modes)
    if cadence is not None:
        out.print(cadence.describe(), soft_wrap=True, markup=False)
    _tier2_failed(tier2_url, t2_error)


def _size(e: inventory.Entry) -> str:
    """Bytes the checkpoint refers to; on content-addressed tier 2 also what its upload
    sent (the rest was there already)."""
    size = format_bytes(e.bytes)
    return size if e.uploaded is None else f"{size} ({format_bytes(e.uploaded)} uploaded)"


def _entries(root: Path, url: str | None, ram: Path | None
             ) -> tuple[list[inventory.Entry], str | None]:
    """The inventory of every tier, or without tier 2 and why tier 2 could not be listed
    (a configuration error still exits 2 at once)."""
    with failures():
        try:
            with tier2(url) as storage:
                return inventory.inventory(root, storage, tier0=ram), None
        except (CheckpointError, OSError) as e:
            if isinstance(e, ConfigError):
                raise
            return inventory.inventory(root, tier0=ram), f"{type(e).__name__}: {e}"


def _tier2_failed(url: str | None, error: str | None) -> None:
    if error is None:
        return
    Console(stderr=True, highlight=False).print(
        f"[bold red]error:[/] [red]tier 2 {escape(str(url))} could not be listed (what is "
        f"shown is tier 1 only): {escape(error)}[/]")
    raise typer.Exit(1)


def _modes_json(r: probe.ProbeResult | None) -> dict[str, Any] | None:
    """The recorded probe's modes (``tierckpt doctor --json`` has the capabilities)."""
    if r is None:
        return None
    return {k: v for k, v in r.to_json().items() if k != "capabilities"}


def _print_modes(r: probe.ProbeResult | None) -> None:
    if r is None:
        return
    m, out = r.modes, console()
    out.print(f"tier 2 {r.url}, as probed {age(max(0.0, time.time() - r.probed_unix))} ago: "
              f"integrity [bold]{m.integrity.value if m.integrity else 'none'}[/]   "
              f"marker [bold]{m.marker.value}[/]   upload [bold]{m.upload.value}[/]")
    for w in m.weaker:
        out.print(f"[yellow]weaker[/]: {w}")
