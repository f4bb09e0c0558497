"""What /proc says about a process (tierckpt/_proc.py), read for real processes: this one,
a child, and one that has exited."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tierckpt import _proc


def test_this_process_is_running_and_its_parent_is_known() -> None:
    fields = _proc.stat_fields(os.getpid())
    assert fields is not None and fields[0] in ("R", "S")
    assert _proc.parent(os.getpid()) == os.getppid()
    assert _proc.parent("self") == os.getppid()
    assert _proc.start_ticks("self") == _proc.start_ticks(os.getpid())


def test_a_child_is_read_and_an_exited_one_is_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                              "marker (with) spaces"])
    try:
        assert _proc.parent(child.pid) == os.getpid()
        deadline = time.monotonic() + 30  # right after exec the kernel may show it empty
        while not (cmd := _proc.cmdline(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cmd is not None and cmd.endswith("marker (with) spaces"), cmd
        start = _proc.start_ticks(child.pid)
        mine = _proc.start_ticks(os.getpid())
        assert start is not None and mine is not None and start >= mine
    finally:
        child.kill()
        child.wait()
    assert _proc.stat_fields(child.pid) is None
    assert _proc.start_ticks(child.pid) is None and _proc.parent(child.pid) is None
    assert _proc.cmdline(child.pid) is None


def test_a_name_with_a_closing_parenthesis_does_not_shift_the_fields() -> None:
    # the command name (field 2) is the executable's name; a ")" in it must not move the rest
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "a) b"
        shutil.copy("/bin/sleep", exe)
        child = subprocess.Popen([str(exe), "30"])
        try:
            assert _proc.parent(child.pid) == os.getpid()
            assert _proc.start_ticks(child.pid) is not None
        finally:
            child.kill()
            child.wait()
