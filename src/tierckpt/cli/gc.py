"""``tierckpt gc``: apply retention to both tiers outside a job; a dry run unless --yes.

A retention flag not given takes the value the job recorded for the root
(``upload-state/policy.json``), else the default; the output says which, knob by knob.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._render import console, emit_json
from tierckpt.cli._tiers import failures, tier1_dir, tier2
from tierckpt.ops import gc as gclib
from tierckpt.tier2.storage.url import FORMS


@command()
def gc(
    tier1: Annotated[Path, typer.Option(help="Tier-1 root.")],
    tier2_url: Annotated[str | None, typer.Option(
        "--tier2", help=f"Tier 2 as {FORMS} (also collect it).")
    ] = None,
    keep_last: Annotated[int | None, typer.Option(
        help="Tier 1: newest complete checkpoints kept (default: the job's, else 3).")
    ] = None,
    upload_every: Annotated[int | None, typer.Option(
        help="The uploader's policy: every Nth step is kept on tier 1 until uploaded "
             "(default: the job's, else 1).")] = None,
    tier2_keep_last: Annotated[int | None, typer.Option(
        help="Tier 2: newest kept (default: the job's, else 3).")] = None,
    tier2_keep_every: Annotated[int | None, typer.Option(
        help="Tier 2: multiples of this step kept forever (0: none) (default: the job's, "
             "else 0).")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Delete (default: only show).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
) -> None:
    """Delete what retention no longer keeps on both tiers; a dry run unless --yes.

    Never the newest complete checkpoint, a pinned one, or one the uploader still has to
    copy. Retention flags not given take the values
    the job recorded for the root when it started with a tier 2, else the defaults. Takes
    the tier-1 lock: exit 1 while a job holds it."""
    root = tier1_dir(tier1)
    with failures():
        resolved = gclib.resolve_policy(root, keep_last=keep_last, upload_every=upload_every,
                                        tier2_keep_last=tier2_keep_last,
                                        tier2_keep_every=tier2_keep_every)
        with tier2(tier2_url) as storage:
            plan = gclib.collect(root, resolved.policy, storage=storage, apply=yes)
    if as_json:
        emit_json({"tier1_root": str(root), "tier2_url": tier2_url, **plan.to_json(),
                   "policy": resolved.to_json()})
        return
    _render(root, tier2_url, plan, resolved)


def _render(root: Path, tier2_url: str | None, plan: gclib.GcPlan,
            resolved: gclib.ResolvedPolicy) -> None:
    """The policy, then a table of each step's action, tier by tier."""
    verb = "deleted" if plan.applied else "would delete"
    out = console()
    out.print(f"gc of {root}" + (f" and {tier2_url}" if tier2_url else "")
              + ("" if plan.applied else " [yellow](dry run: --yes deletes)[/]"))
    out.print(f"policy: {escape(resolved.describe())}")
    rec = resolved.recorded
    if rec is not None and tier2_url and rec.tier2.rstrip("/") != tier2_url.rstrip("/"):
        out.print(f"[yellow]note: the job recorded its policy for tier 2 {escape(rec.tier2)}, "
                  f"not {escape(tier2_url)}[/]")
    t = Table()
    t.add_column("tier", justify="right")
    t.add_column("step", justify="right")
    t.add_column("action")
    for s in plan.tier1:
        t.add_row("1", str(s), f"[red]{verb}[/]")
    for name in plan.tier1_stale:
        t.add_row("1", name, f"[red]{verb}[/] (leftover of a crashed save or delete)")
    for s, why in sorted(plan.tier1_kept.items(), reverse=True):
        t.add_row("1", str(s), f"[green]keep[/] ({why})")
    for s in plan.tier2 or ():
        t.add_row("2", str(s), f"[red]{verb}[/]")
    for s in plan.tier2_kept:
        t.add_row("2", str(s), "[green]keep[/]")
    out.print(t)
