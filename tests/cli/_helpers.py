"""Invoke the real typer app with the planning commands registered."""

from __future__ import annotations

import json
from typing import Any

import typer.main
from typer.testing import CliRunner, Result

import tierckpt.cli.plan
import tierckpt.cli.simulate
import tierckpt.cli.size  # noqa: F401  (each registers its command on the app)
from tierckpt.cli._app import app

RUNNER = CliRunner()


def invoke(*args: str) -> Result:
    """Run ``tierckpt ARGS``; exceptions other than SystemExit propagate (no hiding)."""
    return RUNNER.invoke(app, list(args), catch_exceptions=False)


def invoke_json(*args: str) -> dict[str, Any]:
    """Run with ``--json``, assert success and return the parsed document."""
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict)
    return doc


def flags(command: str) -> set[str]:
    """Every option string of ``command`` (for the tests that freeze the flag set)."""
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {o for p in cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
