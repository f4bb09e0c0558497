"""Running a documented workflow as its page prints it: the page's block, unchanged, in a
fresh interpreter in an empty directory; what it promises is read back from what it left
(the event log, the tiers), never from internals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.test_docs import BLOCKS, ROOT, Block
from tierckpt.format import layout
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

SLOW_STEP = """\
import time, torch
_step = torch.optim.AdamW.step
torch.optim.AdamW.step = lambda self, *a, **k: (time.sleep({s}), _step(self, *a, **k))[1]
"""
"""A ``sitecustomize`` that makes every ``AdamW.step`` take ``{s}`` seconds longer, so a
signal can arrive mid-run; the page's code itself runs unchanged."""


def block(page: str, index: int = 0) -> Block:
    """The ``index``-th runnable block (``<!-- test: run ... -->``) of ``page``."""
    found = [b for b in BLOCKS if b.page == page and b.mark.startswith("run")]
    assert len(found) > index, f"{page} has {len(found)} runnable blocks"
    return found[index]


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(extra or {})}


def run(code: str, cwd: Path, environ: dict[str, str], *, timeout: float = 240,
        until: Callable[[], bool] | None = None,
        send: signal.Signals = signal.SIGTERM) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as ``cwd/snippet.py``; with ``until``, send ``send`` once it holds."""
    script = cwd / "snippet.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if until is not None:
            deadline = time.monotonic() + timeout
            while not until():
                assert proc.poll() is None, f"exited early:\n{proc.communicate()[1][-3000:]}"
                assert time.monotonic() < deadline, "the condition never held"
                time.sleep(0.02)
            proc.send_signal(send)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ok(proc: subprocess.CompletedProcess[str], what: str) -> None:
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{proc.stderr[-3000:]}"


def events(tier1: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The job's events (all ranks), in order; only ``kind`` when given."""
    path = tier1 / layout.EVENTS
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if kind is None or r.get("event") == kind]


def restored_steps(tier1: Path) -> list[int]:
    """The step each start that found a checkpoint restored, in order."""
    return [r["step"] for r in events(tier1, "restore_done")]


def tier1_steps(tier1: Path) -> list[int]:
    """Committed steps on a tier-1 root, newest first."""
    return sorted((s for p in tier1.iterdir()
                   if (s := layout.parse_step_dirname(p.name)) is not None
                   and (p / layout.COMPLETE).exists()), reverse=True)


def tier2_steps(url: str) -> list[int]:
    """Complete steps on tier 2, newest first."""
    storage = open_storage(url)
    try:
        return sorted(Tier2Catalog(storage).complete_steps(), reverse=True)
    finally:
        storage.close()


COVERED = {("README.md", 0), ("README.md", 1), ("docs/preemption.md", 0)}
"""Every runnable block, as ``(page, index)``, with the journey that runs it: README's
loops (test_readme.py) and the preemption loop contract (test_preemption.py)."""
