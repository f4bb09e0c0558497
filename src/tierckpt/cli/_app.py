"""The typer application. Each command lives in its own module and registers itself on
``app`` when imported; ``COMMANDS`` lists those modules (add yours here)."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="tierckpt",
    help="Plan, inspect, verify, upload and drill tierckpt checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

COMMANDS: tuple[str, ...] = ("size", "plan", "simulate", "ls", "verify", "upload", "fetch", "gc",
                              "doctor", "report", "drill", "inspect", "export")


def load_commands() -> typer.Typer:
    """Import every command module so it registers on ``app``; return ``app``."""
    for name in COMMANDS:
        importlib.import_module(f"tierckpt.cli.{name}")
    return app


def main() -> None:
    """Console-script entry point (``tierckpt``)."""
    load_commands()()
