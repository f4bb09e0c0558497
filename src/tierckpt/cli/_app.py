"""The typer application. Each command lives in its own module and registers itself on
``app`` with :func:`command` when imported; ``COMMANDS`` lists those modules (add yours
here).

Importing a command module must not import torch: ``tierckpt --help`` imports them all.
A command that needs torch imports its library modules inside the function, under
:func:`tierckpt.cli._extras.needs_torch` (tests/cli/test_torch_free.py holds the line).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from tierckpt._version import __version__

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="tierckpt",
    help="Plan, inspect, verify, upload and drill tierckpt checkpoints. Every command names "
         "the tiers it touches with --tier1 PATH (a tier-1 root) and --tier2 URL; arguments "
         "without a flag are steps.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

COMMANDS: tuple[str, ...] = ("size", "plan", "simulate", "ls", "verify", "upload", "fetch", "gc",
                              "doctor", "report", "drill", "inspect", "export", "launch", "run")


def command(**settings: Any) -> Callable[[F], F]:
    """``app.command(**settings)`` with the function's docstring as its help, each paragraph
    joined onto one line: typer's rich help keeps a docstring's line breaks, which would cut
    sentences where the source wraps. The first paragraph is the line ``tierckpt --help``
    lists, so keep it to one sentence."""
    def register(f: F) -> F:
        paragraphs = inspect.cleandoc(f.__doc__ or "").split("\n\n")
        text = "\n\n".join(" ".join(p.split()) for p in paragraphs)
        app.command(help=text, **settings)(f)
        return f
    return register


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tierckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    # Only the eager --version lives here: typer needs a callback for options of the app.
    del version


def load_commands() -> typer.Typer:
    """Import every command module so it registers on ``app``; return ``app``."""
    for name in COMMANDS:
        importlib.import_module(f"tierckpt.cli.{name}")
    return app
