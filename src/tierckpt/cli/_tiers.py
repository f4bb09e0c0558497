"""Shared pieces of the commands that touch checkpoints (ls, verify, upload, fetch, gc):
opening tier 2 from ``--tier2``, turning failures into a red line and exit status 1, and
formatting ages.

Exit statuses: 0 success; 1 the operation failed or found damage (a held lock, a bad
CRC32C, an upload that did not verify); 2 bad input (ConfigError, as for the other
commands).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from tierckpt.cli._render import config_errors
from tierckpt.errors import CheckpointError
from tierckpt.policy.units import format_duration
from tierckpt.tier2.storage import Storage, open_storage

EXIT_FAILED = 1
"""Exit status when the operation ran and failed (or found damage)."""


def fail(message: str) -> typer.Exit:
    """Print ``message`` as a red ``error:`` line on stderr; return the Exit to raise."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/] [red]{escape(message)}[/]")
    return typer.Exit(EXIT_FAILED)


@contextmanager
def failures() -> Iterator[None]:
    """ConfigError → exit 2; any other CheckpointError or OSError → exit 1, both in red."""
    with config_errors():
        try:
            yield
        except CheckpointError as e:
            if isinstance(e, ValueError):  # ConfigError: let config_errors render it
                raise
            raise fail(str(e)) from None
        except OSError as e:
            raise fail(f"{type(e).__name__}: {e}") from None


@contextmanager
def tier2(url: str | None) -> Iterator[Storage | None]:
    """The store at ``url`` (None when not given), closed afterwards."""
    if url is None:
        yield None
        return
    storage = open_storage(url)
    try:
        yield storage
    finally:
        storage.close()


def tier1_dir(path: Path) -> Path:
    """``path`` as given, made absolute (for messages and JSON)."""
    return Path(path).expanduser().absolute()


def age(seconds: float | None) -> str:
    """A short age (``"3.3 min"``), or ``"?"`` when unknown."""
    return "?" if seconds is None else format_duration(seconds)
