"""``make demo``'s closing lines: the commands it asks the user to paste are never wrapped."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from tierckpt.cli.demo import commands_to_paste, print_commands


def test_commands_to_paste_print_whole_on_one_line_at_any_width(tmp_path: Path) -> None:
    deep = tmp_path / "a-long-directory-name-for-the-demo-output" / "kill-run [1]" / "tier1"
    commands = commands_to_paste(deep.parent / "drills.json", deep / "events.jsonl")
    assert [what for what, _ in commands] == ["Plan it yourself", "The kill drill's goodput"]
    for width in (40, 80):
        buf = io.StringIO()
        print_commands(Console(file=buf, width=width, force_terminal=False), commands)
        lines = buf.getvalue().splitlines()
        for _, command in commands:
            assert f"  {command}" in lines, (width, lines)  # whole, brackets kept as typed
    assert "'" in commands[1][1]  # the path with a space and brackets is shell-quoted
    assert commands_to_paste("d.json", None) == [
        ("Plan it yourself", "tierckpt plan --from-drill d.json --node-mtbf 32d --nodes 64")]
