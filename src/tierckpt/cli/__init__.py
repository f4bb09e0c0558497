"""Command-line interface: one module per command, each a thin shell over the library."""

from tierckpt.cli._app import app, load_commands, main

__all__ = ["app", "load_commands", "main"]
