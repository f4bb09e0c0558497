"""Invoke the real typer app with the planning commands registered."""

from __future__ import annotations

import json
import re
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


def assert_full_bar(stderr: str, label: str) -> None:
    """``stderr`` holds the final frame of a ``label`` progress bar, finished: the same
    amount on both sides of its "done/total" (e.g. ``74.8/74.8 kB``)."""
    line = next((x for x in stderr.splitlines() if x.startswith(label)), None)
    assert line is not None, f"no {label} progress bar on stderr: {stderr!r}"
    m = re.search(r"(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) (?:bytes|[kMGT]?B)\b", line)
    assert m is not None and m.group(1) == m.group(2) and float(m.group(2)) > 0, line
