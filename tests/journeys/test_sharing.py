"""docs/sharing.md's promise to a serving job: the README's run, then ``tierckpt export
latest`` as the page prints it, gives Hugging Face-layout safetensors that ``safetensors``
reads back equal to the checkpoint's model, with a SHA256SUMS that ``sha256sum -c`` checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tierckpt
from tests.journeys import _run

pytestmark = pytest.mark.slow


def test_an_export_is_read_back_by_safetensors(tmp_path: Path) -> None:
    _run.ok(_run.run(_run.block("README.md", 0).code, tmp_path, _run.env()), "the README run")
    cli = [sys.executable, "-c", "from tierckpt.cli import main; main()"]
    out = subprocess.run([*cli, "export", "latest", "--tier1", "ckpt", "--to", "served"],
                         cwd=tmp_path, env=_run.env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exported step 99" in " ".join(out.stdout.split())
    served = load_file(tmp_path / "served" / "model.safetensors")
    saved = tierckpt.load(str(tmp_path / "ckpt"), None).state_dict
    assert saved is not None and served.keys() == saved.keys() == {"weight", "bias"}
    assert all(torch.equal(served[k], saved[k]) for k in served)
    sha = shutil.which("sha256sum")
    assert sha is not None, "sha256sum (coreutils) is missing"
    check = subprocess.run([sha, "-c", "SHA256SUMS"], cwd=tmp_path / "served",
                           capture_output=True, text=True)
    assert check.returncode == 0 and "model.safetensors: OK" in check.stdout, check.stdout
