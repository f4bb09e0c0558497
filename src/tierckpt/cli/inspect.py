"""``tierckpt inspect``: the tensors in one checkpoint, from its verified metadata only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._extras import needs_torch
from tierckpt.cli._render import console, emit_json
from tierckpt.cli._source import Tier1Option, Tier2Option, TierOption, parse_step, source_of
from tierckpt.cli._tiers import failures
from tierckpt.errors import ConfigError
from tierckpt.policy.units import format_bytes

if TYPE_CHECKING:  # share.contents imports torch: imported by the command when it runs
    from tierckpt.share.contents import Entry


@command()
def inspect(
    step: Annotated[str, typer.Argument(help="Step to inspect, or 'latest'.")] = "latest",
    tier: TierOption = None,
    tier1: Tier1Option = None,
    tier2_url: Tier2Option = None,
    key: Annotated[list[str] | None, typer.Option(
        help="Only entries under this top-level key (model, optim, rank_state); repeatable.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
) -> None:
    """List the entries of one committed checkpoint: name, shape, dtype, bytes, files.

    Then the totals per top-level key. Reads only the marker, manifest and .metadata
    (verified, and unpickled without running any code). Needs PyTorch."""
    with needs_torch("inspect"):
        from tierckpt.share.contents import contents
        from tierckpt.share.source import open_checkpoint
    with failures():
        source = source_of(tier, tier1, tier2_url)
        with open_checkpoint(source, step=parse_step(step)) as ckpt:
            found = contents(ckpt)
        _check_keys(key, found.totals(), found.step)
    entries = [e for e in found.entries if not key or e.key in key]
    if as_json:
        doc = found.to_json()
        doc["entries"] = [e.to_json() for e in entries]
        emit_json(doc)
        return
    out = console()
    crcs = "per-record CRC32C" if found.has_chunk_crcs else "file CRC32C only (older format)"
    out.print(f"step {found.step} at {escape(found.location)}: saved by {found.world_size} "
              f"rank(s), {format_bytes(found.checkpoint_bytes)} in files, {crcs}", soft_wrap=True)
    table = entries_table(entries)
    # A terminal folds long names within the column; a pipe or file gets one line per
    # entry however long its name (rich would otherwise fit it to 80 columns).
    if not out.is_terminal:
        out.width = max(out.width, out.measure(table, options=out.options.update_width(
            1 << 20)).maximum)
    out.print(table)
    totals = Table(title="per key", show_edge=False, pad_edge=False)
    for col in ("key", "entries", "bytes", "stored"):
        totals.add_column(col, justify="left" if col == "key" else "right")
    for k, t in found.totals().items():
        if not key or k in key:
            totals.add_row(k, str(t["entries"]), format_bytes(t["bytes"]),
                           format_bytes(t["stored_bytes"]))
    out.print(totals)


def _check_keys(wanted: Sequence[str] | None, present: Mapping[str, object], step: int) -> None:
    """Refuse a ``--key`` the checkpoint does not hold (ConfigError: exit 2), naming the
    keys it does hold, so a typo never prints an empty table with exit status 0."""
    unknown = sorted(set(wanted or ()) - set(present))
    if unknown:
        raise ConfigError(
            f"--key {', '.join(map(repr, unknown))}: step {step} has no such top-level key; "
            f"its keys are {', '.join(present) or '(none)'}")


def entries_table(entries: Sequence[Entry]) -> Table:
    """One row per entry. Names and file lists fold onto more lines when the console is
    narrow, never cut with an ellipsis; shape, dtype and bytes never wrap."""
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("name", overflow="fold")
    for col in ("shape", "dtype"):
        table.add_column(col, no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("files", overflow="fold")
    for e in entries:
        shape = "×".join(map(str, e.shape)) if e.shape else ("scalar" if e.shape == () else "")
        files = ", ".join(e.files) if len(e.files) <= 2 else f"{len(e.files)} files"
        table.add_row(escape(e.name), shape, e.dtype, format_bytes(e.bytes), files)
    return table
