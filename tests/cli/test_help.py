"""The whole command line: ``--version``, ``-h``, one way to name the tiers, and help text
that reads as written (no line breaks inside a sentence, nothing eaten by rich markup)."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.core import TyperArgument, TyperOption
from typer.testing import CliRunner

from tierckpt import __version__
from tierckpt.cli import load_commands
from tierckpt.cli._app import COMMANDS

APP = load_commands()
GROUP = typer.main.get_group(APP)
RUNNER = CliRunner()
WIDE = {"COLUMNS": "250"}
"""Wide enough that no help line wraps: what is left of a break was in the source."""


def _help(*args: str) -> str:
    result = RUNNER.invoke(APP, [*args, "--help"], env=WIDE, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def _flat(text: str) -> str:
    """Rendered help as one line of words (box edges dropped)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_version_and_short_help() -> None:
    result = RUNNER.invoke(APP, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"tierckpt {__version__}\n"
    assert RUNNER.invoke(APP, ["-h"], env=WIDE).stdout == _help()
    assert RUNNER.invoke(APP, ["plan", "-h"], env=WIDE).stdout == _help("plan")


@pytest.mark.parametrize("name", COMMANDS)
def test_tiers_are_named_by_flags(name: str) -> None:
    """A tier-1 root is always ``--tier1 PATH`` and a tier-2 URL ``--tier2 URL``, never an
    argument: ``verify 39 --tier1 t1`` and ``ls --tier1 t1`` take it the same way."""
    cmd = GROUP.commands[name]
    flag = {"tier1": "--tier1", "tier2": "--tier2", "tier2_url": "--tier2"}
    for p in cmd.params:
        if p.name in flag:
            assert isinstance(p, TyperOption) and p.opts == [flag[p.name]], (name, p.opts)
    args = [p.name for p in cmd.params if isinstance(p, TyperArgument)]
    assert set(args) <= {"step", "command"}, (name, args)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_keeps_sentences_whole(name: str) -> None:
    cmd = GROUP.commands[name]
    assert cmd.help and all("\n" not in para for para in cmd.help.split("\n\n")), cmd.help
    text = _help(name)
    flat = _flat(text)
    assert not re.search(r" \.(\s|$)", text), text  # e.g. a "[default: ...]" eaten as markup
    assert " ".join(cmd.help.split("\n\n")[0].split()) in flat
    for p in cmd.params:
        if isinstance(p, TyperOption) and p.help:
            assert "\n" not in p.help and " ".join(p.help.split()) in flat, (name, p.help)


def test_the_command_list_shows_one_line_each() -> None:
    text = _help()
    panel = text[text.index("─ Commands ─"):].splitlines()[1:]
    rows = panel[:panel.index(next(line for line in panel if line.startswith("╰")))]
    # One row per command, none continued (the order is the order of registration).
    assert sorted(row.split()[1] for row in rows) == sorted(COMMANDS), rows
