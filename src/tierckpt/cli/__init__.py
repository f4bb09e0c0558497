"""Command-line interface: one module per command, each a thin shell over the library.

Nothing here imports typer or rich at import time, so that :func:`main`, the ``tierckpt``
console script, can say which extra to install when they are missing. ``app`` and
``load_commands`` come from :mod:`tierckpt.cli._app` on first use (PEP 562).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierckpt.cli._app import app, load_commands

__all__ = ["CLI_EXTRA", "app", "load_commands", "main"]

CLI_EXTRA = "tierckpt's command line needs its extra: pip install 'tierckpt[cli]'"
"""What :func:`main` prints when typer or rich cannot be imported."""

_CLI_DEPENDENCIES = frozenset({"typer", "rich", "click"})
"""Top-level packages of the ``cli`` extra (click comes with typer)."""


def main() -> None:
    """Console-script entry point (``tierckpt``). Exit status 1 with :data:`CLI_EXTRA` on
    stderr when the ``cli`` extra is missing; any other ImportError propagates."""
    try:
        from tierckpt.cli._app import load_commands

        app = load_commands()
    except ImportError as e:
        if (e.name or "").partition(".")[0] not in _CLI_DEPENDENCIES:
            raise
        print(f"{CLI_EXTRA}\n({type(e).__name__}: {e})", file=sys.stderr)
        raise SystemExit(1) from None
    app()


def __getattr__(name: str) -> Any:
    if name in ("app", "load_commands"):
        from tierckpt.cli import _app

        return getattr(_app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
