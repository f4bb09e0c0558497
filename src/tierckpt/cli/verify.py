"""``tierckpt verify``: every byte of one checkpoint on one tier against its CRC32C."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from tierckpt.cli._app import command
from tierckpt.cli._render import console, emit_json
from tierckpt.cli._tiers import EXIT_FAILED, fail, failures, tier1_dir, tier2
from tierckpt.errors import ConfigError
from tierckpt.ops import check
from tierckpt.policy.units import format_bytes
from tierckpt.tier2.storage.url import FORMS


@command()
def verify(
    step: Annotated[int, typer.Argument(help="Step of the checkpoint to verify.")],
    tier: Annotated[int, typer.Option(help="Which tier to read: 1 or 2.")] = 1,
    tier1: Annotated[Path | None, typer.Option(
        help="Tier-1 root (needed for --tier 1).")] = None,
    tier2_url: Annotated[str | None, typer.Option(
        "--tier2", help=f"Tier 2 as {FORMS} (needed for --tier 2).")
    ] = None,
    parallel: Annotated[int, typer.Option(help="Tier 2: objects downloaded at once.")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
) -> None:
    """Check every byte of one checkpoint on one tier against its CRC32C.

    Marker, manifest, sizes and the CRC32C of every file (tier 2: downloaded to a temporary
    directory and removed). Exit 1 naming the first bad file."""
    with failures():
        if tier not in (1, 2):
            raise ConfigError(f"--tier must be 1 or 2, got {tier}")
        if tier == 1:
            if tier1 is None:
                raise ConfigError("--tier 1 needs --tier1 DIR (the tier-1 root)")
            report = check.check_tier1(tier1_dir(tier1), step)
        else:
            if tier2_url is None:
                raise ConfigError(f"--tier 2 needs --tier2 URL ({FORMS})")
            with tier2(tier2_url) as storage:
                assert storage is not None
                report = check.check_tier2(storage, step, parallel=parallel)
    if as_json:
        emit_json(report.to_json())
        if not report.ok:
            raise typer.Exit(EXIT_FAILED)
        return
    if not report.ok:
        raise fail(f"step {step} on tier {tier} ({report.location}): {report.error}")
    out = console()
    out.print(f"[green]ok[/]: step {step} on tier {tier} ({escape(report.location)}): "
              f"{report.files} files, {format_bytes(report.bytes)} match their CRC32C "
              f"({report.seconds:.2f} s)")
    if report.elsewhere:
        out.print(f"{len(report.elsewhere)} files are held by other nodes' tier 1 "
                  "(not checked here)")
