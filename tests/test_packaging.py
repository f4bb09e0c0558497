"""The built wheel installs and works outside the source tree.

One test, in the order a user meets the package: build the wheel (from a copy of the tree, so
two runs never share setuptools' ``build/`` and ``*.egg-info``), check what it ships, install
it with ``[cli,s3]`` into a fresh venv, and run the ``tierckpt`` command and a 1-process save
and restore from a directory outside the repo.

No network: the fresh venv sees the dev venv's packages (torch, typer, boto3, …) through a
``.pth`` file pointing at a view of its site-packages *without* the editable tierckpt, and pip
runs with ``--no-index``, so the dependencies resolve against what is installed. The test
asserts that ``tierckpt`` is imported from the fresh venv, not from ``src/``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests._require import require
from tierckpt._version import __version__

REPO = Path(__file__).resolve().parents[1]

SAVE_RESTORE = """
import sys

import torch
from torch import nn

import tierckpt

root = sys.argv[1]
print("tierckpt", tierckpt.__file__)
torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.randn(2, 8)).pow(2).sum().backward()
opt.step()  # so the optimizer has state (exp_avg, exp_avg_sq) to save
saved_model = {k: v.clone() for k, v in model.state_dict().items()}
saved_optim = {k: v.clone() for k, v in opt.state[model.weight].items()}
with tierckpt.CheckpointManager(tier1=root) as ckpt:
    assert ckpt.restore(tierckpt.TrainState(model=model, optimizer=opt)) is None
    ckpt.save(3, tierckpt.TrainState(model=model, optimizer=opt))
    ckpt.wait()

torch.manual_seed(1)  # another init: every value below must come from the checkpoint
model2 = nn.Linear(8, 4)
opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
with tierckpt.CheckpointManager(tier1=root) as ckpt:
    info = ckpt.restore(tierckpt.TrainState(model=model2, optimizer=opt2))
assert info is not None and info.step == 3, info
for k, v in saved_model.items():
    assert torch.equal(model2.state_dict()[k], v), k
for k, v in saved_optim.items():
    assert torch.equal(opt2.state[model2.weight][k], v), k
print(f"restored step {info.step}: {len(saved_model)} model and "
      f"{len(saved_optim)} optimizer tensors equal")
"""


def _run(cmd: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 180) -> str:
    """Run ``cmd``; return stdout+stderr, or fail the test with all of it."""
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout, check=False)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{out}")
    return out


def _require_build_tools() -> None:
    try:
        setuptools_version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        setuptools_version = "0"
    major = int(setuptools_version.split(".")[0])
    require(major >= 77, f"setuptools>=77 is needed to build the wheel without build isolation "
                         f"(found {setuptools_version}); `make venv` installs the dev extra")
    for name in ("pip", "typer", "rich", "boto3"):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            require(False, f"{name} is not installed in the dev venv; `make venv` installs it")


def _build_wheel(tmp: Path) -> tuple[Path, str]:
    tree = tmp / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    log = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                "--disable-pip-version-check", "-w", tmp / "dist", tree], cwd=tmp)
    wheels = list((tmp / "dist").glob("tierckpt-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], log


def _check_wheel(wheel: Path, build_log: str) -> None:
    assert wheel.name == f"tierckpt-{__version__}-py3-none-any.whl"
    # A deprecated pyproject field (e.g. `license = {text = ...}`) prints this banner.
    assert "SetuptoolsDeprecationWarning" not in build_log, build_log
    dist_info = f"tierckpt-{__version__}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    stray = sorted(n for n in names if not n.startswith(("tierckpt/", f"{dist_info}/")))
    assert not stray, f"the wheel ships files outside the package: {stray}"
    for needed in ("tierckpt/py.typed", "tierckpt/_version.py", "tierckpt/cli/plan.py",
                   f"{dist_info}/licenses/LICENSE"):
        assert needed in names, f"{needed} is missing from the wheel"
    assert "License-Expression: Apache-2.0" in meta
    assert f"Version: {__version__}" in meta
    assert "tierckpt = tierckpt.cli:main" in entry_points


def _fresh_venv(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A venv whose own site-packages is empty and which sees the dev venv's packages, all
    but tierckpt, through a .pth file. Returns its bin dir and the environment to run it in."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp).strip())
    view = tmp / "dev-site-packages"
    view.mkdir()
    for d in {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}:
        for entry in Path(d).iterdir():
            low = entry.name.lower()
            if ("tierckpt" in low or entry.suffix == ".pth"
                    or (view / entry.name).exists()):
                continue
            (view / entry.name).symlink_to(entry)
    (site / "dev-deps.pth").write_text(f"{view}\n")
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", NO_COLOR="1",
               COLUMNS="100")
    return venv / "bin", env


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_source_tree(tmp_path: Path) -> None:
    _require_build_tools()
    wheel, build_log = _build_wheel(tmp_path)
    _check_wheel(wheel, build_log)
    print("built", wheel.name)  # these lines are the record a reviewer reads (pytest -rP)

    bin_dir, env = _fresh_venv(tmp_path)
    away = tmp_path / "elsewhere"  # the cwd of every command: not the repo, no src/ on a path
    away.mkdir()
    _run([bin_dir / "python", "-m", "pip", "install", "--no-index", f"{wheel}[cli,s3]"],
         cwd=away, env=env)
    installed = _run([bin_dir / "python", "-c", "import tierckpt; print(tierckpt.__file__)"],
                     cwd=away, env=env).strip()
    assert Path(installed).is_relative_to(bin_dir.parent), (
        f"tierckpt was imported from {installed}, not from the fresh venv")
    print("installed [cli,s3] without an index; imported from", installed)

    tierckpt = bin_dir / "tierckpt"
    assert "--blocking" in _run([tierckpt, "plan", "--help"], cwd=away, env=env)
    doc = json.loads(_run([tierckpt, "plan", "--blocking", "5s", "--restart", "5m",
                           "--node-mtbf", "32d", "--nodes", "64", "--json"], cwd=away, env=env))
    # Young: sqrt(2 C M), M = node MTBF / nodes = 32 d / 64 = 12 h.
    assert doc["inputs"]["nodes"] == 64
    assert math.isclose(doc["young_interval_s"], math.sqrt(2 * 5 * 12 * 3600), rel_tol=1e-9)
    print(f"tierckpt plan --help, then plan --json: interval {doc['interval_s']:.1f} s")

    script = away / "save_restore.py"
    script.write_text(textwrap.dedent(SAVE_RESTORE))
    out = _run([bin_dir / "python", script, away / "ckpt"], cwd=away, env=env)
    assert f"tierckpt {installed}" in out and "restored step 3" in out, out
    print(next(line for line in out.splitlines() if line.startswith("restored step")))

    version = _run([tierckpt, "--version"], cwd=away, env=env)
    assert __version__ in version, version
    print("tierckpt --version:", version.strip())
