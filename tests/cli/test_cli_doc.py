"""docs/cli.md tells the truth about the command line: it counts the commands the typer app
registers, lists each in its table, and each library function it names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import typer.main

import tierckpt.cli.ls  # noqa: F401  (registers the command)
from tierckpt.cli._app import load_commands

from ._helpers import invoke

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
WORDS = {12: "Twelve", 13: "Thirteen", 14: "Fourteen", 15: "Fifteen", 16: "Sixteen",
         17: "Seventeen", 18: "Eighteen", 19: "Nineteen", 20: "Twenty"}


def _commands() -> list[str]:
    return list(typer.main.get_command(load_commands()).commands)  # type: ignore[attr-defined]


def _table() -> dict[str, str]:
    """Command name → the library column, from the page's table of commands."""
    out = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| `tierckpt "):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]  # not at \|
            out[cells[0].split()[1].rstrip("`")] = cells[-1]
    return out


def test_the_page_counts_and_lists_every_command() -> None:
    commands = _commands()
    text = DOC.read_text()
    assert f"{WORDS[len(commands)]} commands" in text, \
        f"docs/cli.md must say '{WORDS[len(commands)]} commands' ({', '.join(commands)})"
    assert sorted(_table()) == sorted(commands)


def test_every_library_function_the_table_names_exists() -> None:
    for command, cell in _table().items():
        first = cell.split("`")[1]  # `a.b.f` / `g`: the first is fully qualified
        module, _, name = first.rpartition(".")
        assert hasattr(importlib.import_module(module), name), (command, first)


def test_the_ls_example_has_the_columns_ls_prints(template: Path) -> None:
    """The example was pasted from real output; a column added since must be pasted too."""
    def header(text: str) -> list[str]:
        line = next(x for x in text.splitlines() if x.startswith("┃ step"))
        return [c.strip() for c in line.split("┃")[1:-1]]

    result = invoke("ls", "--tier1", str(template))
    assert result.exit_code == 0, result.output
    example = DOC.read_text().split("$ tierckpt ls --tier1", 1)[1]
    assert header(example) == header(result.stdout)
