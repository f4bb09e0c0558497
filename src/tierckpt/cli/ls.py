"""``tierckpt ls``: every checkpoint on tier 1 (and tier 2) with its state, size and age."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._render import console, emit_json
from tierckpt.cli._tiers import age, failures, tier1_dir, tier2
from tierckpt.format import layout
from tierckpt.ops import inventory
from tierckpt.policy.units import format_bytes

_STYLE = {"partial": "yellow", "invalid": "bold red", "complete": "cyan",
          "uploading": "magenta", "upload_failed": "bold red", "verified": "green",
          "conflict": "bold red"}


@command()
def ls(
    tier1: Annotated[Path, typer.Option(help="Tier-1 root (the job's tier1 directory).")],
    tier2_url: Annotated[str | None, typer.Option(
        "--tier2", help="Tier 2 as s3://bucket/prefix or file:///path (also list it).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
) -> None:
    """List every checkpoint on tier 1 (and tier 2) with its state, size and age.

    States: complete, partial, uploading, upload failed, verified, invalid, conflict; pinned
    checkpoints name their holders."""
    root = tier1_dir(tier1)
    with failures(), tier2(tier2_url) as storage:
        entries = inventory.inventory(root, storage)
    if as_json:
        emit_json({"tier1": str(root), "tier2": tier2_url,
                   "checkpoints": [e.to_json() for e in entries]})
        return
    out = console()
    if not entries:
        out.print(f"no checkpoints in {root}" + (f" or {tier2_url}" if tier2_url else ""))
        return
    t = Table(title=f"Checkpoints in {root}" + (f" and {tier2_url}" if tier2_url else ""))
    for col, just in (("step", "right"), ("tier", "right"), ("state", "left"),
                      ("pinned", "left"), ("size", "right"), ("age", "right"),
                      ("integrity", "left"), ("detail", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for e in entries:
        name = str(e.step) if e.name == layout.step_dirname(e.step) else e.name
        style = _STYLE.get(e.state, "")
        state = e.state.replace("_", " ")  # "upload failed"
        t.add_row(name, str(e.tier), f"[{style}]{state}[/]" if style else state,
                  ", ".join(e.pinned_by), format_bytes(e.bytes), age(e.age_s),
                  e.integrity or "", e.detail or "")
    out.print(t)
