"""Fixtures the framework drop-ins' tests share."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_TOP_LEVEL_AFTER_IMPORT = (
    "import json, sys, tierckpt, tierckpt.integrations; tierckpt.CheckpointManager; "
    "tierckpt.TrainState; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")


@pytest.fixture(scope="session")
def imported_by_tierckpt() -> frozenset[str]:
    """The top-level packages a fresh interpreter holds after ``import tierckpt,
    tierckpt.integrations`` and a touch of ``CheckpointManager`` and ``TrainState``: one
    interpreter for the Lightning, Accelerate and torchtitan tests that importing tierckpt
    never imports their framework (each asserts its own)."""
    proc = subprocess.run([sys.executable, "-c", _TOP_LEVEL_AFTER_IMPORT], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = frozenset(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert {"tierckpt", "torch"} <= names, sorted(names)
    return names
