"""docs/preemption.md's loop contract as printed: a SIGTERM mid-run ends the process with
status 75 after the agreed step is saved, and the next run resumes right after that step
(0 steps lost)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.journeys import _run

pytestmark = pytest.mark.slow


def test_a_sigterm_costs_no_step_and_exits_75(tmp_path: Path) -> None:
    code, ckpt = _run.block("docs/preemption.md", 0).code, tmp_path / "ckpt"
    (tmp_path / "sitecustomize.py").write_text(_run.SLOW_STEP.format(s=0.03))
    env = _run.env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    first = _run.run(code, tmp_path, env, send=signal.SIGTERM,
                     until=lambda: any(_run.events(ckpt, "save_committed")))
    assert first.returncode == 75, first.stderr[-3000:]
    [stop] = [e["step"] for e in _run.events(ckpt, "preempt_stop")]
    assert 9 <= stop < 99 and _run.tier1_steps(ckpt)[0] == stop  # saved at the agreed step
    _run.ok(_run.run(code, tmp_path, env), "run 2")
    assert _run.restored_steps(ckpt) == [stop]  # the loop goes on at stop + 1: none lost
    assert _run.tier1_steps(ckpt)[0] == 99
