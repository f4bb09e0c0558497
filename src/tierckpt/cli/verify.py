"""``tierckpt verify``: every byte of one checkpoint on one tier against its CRC32C."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Protocol

import typer
from rich.console import Console
from rich.markup import escape

from tierckpt.cli._app import command
from tierckpt.cli._render import console, emit_json, transfer_bar
from tierckpt.cli._tiers import EXIT_FAILED, fail, failures, tier1_dir, tier2
from tierckpt.errors import ConfigError
from tierckpt.ops import check, repair, scrub
from tierckpt.policy.units import format_bytes
from tierckpt.tier2.storage.url import FORMS


class _Report(Protocol):
    """What every verify report offers the renderers."""

    @property
    def ok(self) -> bool: ...

    def to_json(self) -> dict[str, Any]: ...


def _emitted(report: _Report, as_json: bool) -> bool:
    """With ``--json``: print ``report`` and exit 1 unless it is ok; True when printed."""
    if not as_json:
        return False
    emit_json(report.to_json())
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)
    return True


def _print_repaired(out: Console, repaired: Iterable[tuple[str, str]]) -> None:
    """One line per object sent again: its name and the tier-1 copy it came from."""
    for name, source in repaired:
        out.print(f"repaired: {escape(name)} sent again from {escape(source)}")


@command()
def verify(
    step: Annotated[int | None, typer.Argument(
        help="Step of the checkpoint to verify (or --all).", show_default=False)] = None,
    tier: Annotated[int, typer.Option(help="Which tier to read: 1 or 2.")] = 1,
    tier1: Annotated[Path | None, typer.Option(
        help="Tier-1 root (needed for --tier 1).")] = None,
    tier2_url: Annotated[str | None, typer.Option(
        "--tier2", help=f"Tier 2 as {FORMS} (needed for --tier 2).")
    ] = None,
    parallel: Annotated[int, typer.Option(help="Tier 2: objects checked at once.")] = 4,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Tier 2: send each damaged or missing object again from --tier1 "
                         "(a copy whose bytes verify); nothing is deleted.")] = False,
    every: Annotated[bool, typer.Option(
        "--all", help="Tier 2: every complete step, each object read once (a scrub).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
) -> None:
    """Check every byte of one checkpoint on one tier against its CRC32C.

    Marker, manifest, sizes and the CRC32C of every file (tier 2: downloaded to a temporary
    directory and removed, with a progress bar on stderr unless --json). Exit 1 naming the
    first bad file."""
    if every:
        _scrub(step, tier, tier1 if repair else None, tier2_url, parallel, repair, as_json)
        return
    if step is None:
        with failures():
            raise ConfigError("give the STEP to verify, or --all (tier 2)")
    if repair:
        _repair(step, tier, tier1, tier2_url, parallel, as_json)
        return
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
            with tier2(tier2_url) as storage, \
                    transfer_bar("verify", disable=as_json) as progress:
                assert storage is not None
                report = check.check_tier2(storage, step, parallel=parallel,
                                           progress=progress)
    if _emitted(report, as_json):
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


def _repair(step: int, tier: int, tier1: Path | None, tier2_url: str | None,
            parallel: int, as_json: bool) -> None:
    """``verify --repair``: tier 2's step checked, its bad objects sent again from tier 1."""
    with failures():
        if tier != 2 or tier2_url is None or tier1 is None:
            raise ConfigError("--repair mends tier 2 from tier 1: give --tier 2, --tier2 URL "
                              "and --tier1 DIR (the tier-1 root holding this node's copy)")
        with tier2(tier2_url) as storage, transfer_bar("repair", disable=as_json) as progress:
            assert storage is not None
            report = repair.repair_tier2(storage, step, tier1_dir(tier1), parallel=parallel,
                                         progress=progress)
    if _emitted(report, as_json):
        return
    out = console()
    _print_repaired(out, report.repaired)
    for _name, why in report.left:
        out.print(f"[red]still bad[/]: {escape(why)}")
    if not report.ok:
        raise fail(f"step {step} on tier 2 ({report.location}): "
                   f"{report.error or f'{len(report.left)} file(s) still bad'}")
    out.print(f"[green]ok[/]: step {step} on tier 2 ({escape(report.location)}): "
              f"{report.files} files verify, {len(report.repaired)} repaired "
              f"({report.seconds:.2f} s)")


def _scrub(step: int | None, tier: int, tier1: Path | None, tier2_url: str | None,
           parallel: int, repair: bool, as_json: bool) -> None:
    """``verify --all``: every complete step of tier 2, each object once; ``--repair``
    sends the bad ones again from ``tier1``."""
    with failures():
        if step is not None or tier != 2 or tier2_url is None:
            raise ConfigError("--all scrubs tier 2: give --tier 2 and --tier2 URL, and no STEP")
        if repair and tier1 is None:
            raise ConfigError("--all --repair mends tier 2 from tier 1: give --tier1 DIR")
        with tier2(tier2_url) as storage, transfer_bar("scrub", disable=as_json) as progress:
            assert storage is not None
            report = scrub.scrub_tier2(storage, parallel=parallel,
                                       tier1=tier1_dir(tier1) if tier1 else None,
                                       progress=progress)
    if _emitted(report, as_json):
        return
    out = console()
    _print_repaired(out, report.repaired)
    for s, why in report.bad:
        out.print(f"[red]bad[/]: step {s}: {escape(why)}")
    if not report.ok:
        raise fail(f"{len(report.bad)} of {len(report.steps)} complete steps on tier 2 "
                   f"({report.location}) do not verify")
    out.print(f"[green]ok[/]: {len(report.steps)} steps on tier 2 ({escape(report.location)})"
              f": {report.objects} objects, {format_bytes(report.bytes)} match their CRC32C, "
              f"{len(report.repaired)} repaired ({report.seconds:.2f} s)")
