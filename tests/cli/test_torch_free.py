"""The command line starts without torch, and says what to install when something is missing.

Every check runs a fresh interpreter (``subprocess``): this test process has imported torch
long ago. ``tierckpt --help`` and the commands that read no tensors (plan, size, simulate,
ls, verify, upload, fetch, gc, doctor, report) must not import torch, neither for their
``--help`` nor when they run; inspect, export and drill import it when they run and, without
it, exit 1 with a line naming what to install. Without typer or rich, the ``tierckpt``
entry point names the ``cli`` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.cli import CLI_EXTRA

from ._checkpoints import clone

LIGHT = ("plan", "size", "simulate", "ls", "verify", "upload", "fetch", "gc", "doctor",
         "report")
"""The commands that must start, and run, without torch."""

_SCRIPT = """
import json, sys

class Block:
    '''Refuse to import the packages named in BLOCKED, as if they were not installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

BLOCKED = set(json.loads(sys.argv[1]))
sys.meta_path.insert(0, Block())
from tierckpt.cli import main

codes = []
for argv in json.loads(sys.argv[2]):
    sys.argv = ["tierckpt", *argv]
    try:
        main()
        codes.append(0)
    except SystemExit as e:
        codes.append(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    if "torch" in sys.modules:
        print(f"TORCH IMPORTED by {argv}", file=sys.stderr)
        sys.exit(99)
print("RESULT " + json.dumps(codes), file=sys.stderr)
"""


def run_cli(*argvs: list[str], block: tuple[str, ...] = ()
            ) -> tuple[list[int], subprocess.CompletedProcess[str]]:
    """Run ``tierckpt ARGV`` for each ARGV in one fresh interpreter in which the packages in
    ``block`` cannot be imported; fail if torch was imported after any of them. Returns the
    exit status of each and the finished process."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(block), json.dumps(argvs)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    assert "TORCH IMPORTED" not in proc.stderr, proc.stderr
    result = [line for line in proc.stderr.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stdout + proc.stderr
    return json.loads(result[-1].removeprefix("RESULT ")), proc


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--version"],
                                  *([c, "--help"] for c in LIGHT)], ids=" ".join)
def test_help_and_version_start_without_torch(argv: list[str]) -> None:
    codes, proc = run_cli(argv)
    assert codes == [0], proc.stdout + proc.stderr
    assert ("Usage: tierckpt" in proc.stdout) or proc.stdout.startswith("tierckpt ")


def test_plan_notice_runs_without_torch() -> None:
    codes, proc = run_cli(["plan", "--notice", "30s", "--notice", "2m", "--size-per-node",
                           "10GB", "--tier1-rate", "1GB/s", "--tier2-rate", "200MB/s"],
                          block=("torch",))
    assert codes == [0], proc.stdout + proc.stderr
    assert "terminationGracePeriodSeconds" in proc.stdout


@pytest.mark.slow
def test_light_commands_run_without_torch(template: Path, tmp_path: Path) -> None:
    t1, t2, fresh = clone(template, tmp_path / "t1"), tmp_path / "t2", tmp_path / "fresh"
    t2.mkdir()
    plan = ["--blocking", "5s", "--restart", "5m", "--job-mtbf", "12h", "--json"]
    codes, proc = run_cli(
        ["size", "--params", "8B", "--node-ram", "2TiB", "--json"],
        ["plan", *plan],
        ["simulate", *plan, "--job-length", "10d", "--replicas", "5", "--no-sweep"],
        ["upload", "--tier1", str(t1), "--tier2", t2.as_uri(), "--json"],
        ["fetch", "3", "--tier1", str(fresh), "--tier2", t2.as_uri(), "--json"],
        ["ls", "--tier1", str(t1), "--tier2", t2.as_uri(), "--json"],
        ["verify", "3", "--tier1", str(fresh), "--json"],
        ["verify", "3", "--tier", "2", "--tier2", t2.as_uri(), "--json"],
        ["gc", "--tier1", str(t1), "--tier2", t2.as_uri(), "--json"],
        ["doctor", "--tier2", t2.as_uri(), "--json"],
        ["report", "--tier1", str(t1), "--json"])
    assert codes == [0] * 11, proc.stdout + proc.stderr
    assert (fresh / "step-00000003" / "COMPLETE").is_file()


@pytest.mark.parametrize("argv", [["inspect", "latest"], ["export", "latest", "--to", "x"],
                                  ["drill", "--", "python", "train.py"]], ids=lambda a: a[0])
def test_commands_that_need_torch_say_so_without_it(argv: list[str], tmp_path: Path) -> None:
    """With torch blocked: exit 1 and one line naming what to install, no traceback; the
    light commands still work in the same interpreter."""
    if argv[0] != "drill":
        argv = [*argv, "--tier1", str(tmp_path)]
    codes, proc = run_cli(argv, ["plan", "--help"], block=("torch",))
    assert codes == [1, 0], proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    assert f"tierckpt {argv[0]} needs PyTorch" in err and "pip install torch" in err
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("missing", ["typer", "rich"])
def test_the_entry_point_names_the_cli_extra(missing: str) -> None:
    codes, proc = run_cli(["plan", "--help"], block=(missing,))
    assert codes == [1] and CLI_EXTRA in proc.stderr and "Traceback" not in proc.stderr
    assert "pip install 'tierckpt[cli]'" in CLI_EXTRA and proc.stdout == ""
