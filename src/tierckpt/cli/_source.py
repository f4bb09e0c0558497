"""The checkpoint a sharing command (``inspect``, ``export``) reads: ``STEP`` (a number or
``latest``) on ``--tier1 DIR`` or ``--tier2 URL`` (``--tier`` picks when both are given):
the three options, and the source they name (:func:`source_of`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.url import FORMS

if TYPE_CHECKING:  # share.source imports torch; the CLI's light commands must not
    from tierckpt.share.source import Step

# A sharing command's source options; ``tier2_url: Tier2Option = None`` reads as --tier2.
TierOption = Annotated[int | None, typer.Option(
    help="Which tier to read (1 or 2) when both --tier1 and --tier2 are given.")]
Tier1Option = Annotated[Path | None, typer.Option(help="Tier-1 root, or one step directory.")]
Tier2Option = Annotated[str | None, typer.Option(
    "--tier2", help=f"Tier 2 as {FORMS}.")]


def parse_step(text: str) -> Step:
    """``"latest"`` or a non-negative step number."""
    if text == "latest":
        return "latest"
    try:
        step = int(text)
    except ValueError:
        raise ConfigError(f"STEP must be a step number or 'latest', got {text!r}") from None
    if step < 0:
        raise ConfigError(f"STEP must be >= 0, got {step}")
    return step


def source_of(tier: int | None, tier1: Path | None, tier2: str | None) -> str:
    """The source to open: the tier-1 root or the tier-2 URL, as the options say."""
    if tier not in (None, 1, 2):
        raise ConfigError(f"--tier must be 1 or 2, got {tier}")
    if tier is None:
        if tier1 is not None and tier2 is not None:
            raise ConfigError("both --tier1 and --tier2 given: say which to read with --tier")
        tier = 2 if tier2 is not None else 1
    if tier == 1:
        if tier1 is None:
            raise ConfigError("reading tier 1 needs --tier1 DIR (a tier-1 root or a step "
                              "directory)")
        return str(Path(tier1).expanduser().absolute())
    if tier2 is None:
        raise ConfigError(f"reading tier 2 needs --tier2 URL ({FORMS})")
    return tier2
