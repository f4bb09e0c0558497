"""``tierckpt fetch``: bring one checkpoint from tier 2 back to a tier-1 root, verified."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierckpt.cli._app import command
from tierckpt.cli._render import console, emit_json, transfer_bar
from tierckpt.cli._tiers import failures, tier1_dir, tier2
from tierckpt.errors import ConfigError, NoCheckpointError
from tierckpt.format import layout
from tierckpt.policy.units import format_bytes
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.fetch import fetch_into_tier1
from tierckpt.tier2.storage.url import FORMS


@command()
def fetch(
    step: Annotated[int, typer.Argument(help="Step of the checkpoint to fetch.")],
    tier1: Annotated[Path, typer.Option(help="Tier-1 root to fetch into (created).")],
    tier2_url: Annotated[str, typer.Option(
        "--tier2", help=f"Tier 2 as {FORMS}.")],
    full: Annotated[bool, typer.Option(
        "--full/--sizes",
        help="Reuse a local file only if its CRC32C matches (--full) or its size (--sizes)."
    )] = True,
    parallel: Annotated[int, typer.Option(help="Objects downloaded at once.")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md).")] = False,
) -> None:
    """Download checkpoint STEP from --tier2 into --tier1, verified and committed.

    Each object is checked against the manifest's CRC32C and committed with COMPLETE last;
    intact local files are reused; a progress bar on stderr (not with --json). Takes the
    root's lock: refuses while a job writes to the tier-1 root."""
    root = tier1_dir(tier1)
    with failures():
        if step < 0:
            raise ConfigError(f"STEP must be >= 0, got {step}")
        if parallel < 1:
            raise ConfigError(f"--parallel must be >= 1, got {parallel}")
        with tier2(tier2_url) as storage:
            assert storage is not None
            catalog = Tier2Catalog(storage)
            remote = catalog.complete_steps()
            if step not in remote:
                raise NoCheckpointError(
                    f"no complete step {step} on {storage.url} (complete there: "
                    f"{', '.join(map(str, reversed(remote))) or 'none'})")
            root.mkdir(parents=True, exist_ok=True)
            local = Tier1Catalog(root)
            lock = local.lock()
            try:
                with transfer_bar("fetch", disable=as_json) as progress:
                    downloaded, reused = fetch_into_tier1(catalog, local, step, names=None,
                                                          full=full, parallel=parallel,
                                                          progress=progress)
            finally:
                lock.release()
    path = root / layout.step_dirname(step)
    if as_json:
        emit_json({"step": step, "path": str(path), "tier2": tier2_url,
                   "bytes_downloaded": downloaded, "bytes_reused": reused})
        return
    console().print(f"[green]fetched[/] step {step} into {path}: "
                    f"{format_bytes(downloaded)} downloaded, {format_bytes(reused)} reused")
