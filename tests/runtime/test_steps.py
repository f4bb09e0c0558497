"""Step marks without a watchdog (runtime/steps.py): the manager names the steps the goodput
report needs from what the loop already does — restore(), save(step), optimizer.step() —
and the README's smallest loop, run exactly as printed, gets a sensible report."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_docs import ROOT, RUN
from tierckpt.policy import goodput
from tierckpt.runtime import events as ev
from tierckpt.runtime.save_cost import SaveCostMeter
from tierckpt.runtime.steps import StepMarks


def _of(path: Path, kind: str) -> list[dict]:
    return [r for r in ev.read_events(path) if r["event"] == kind]


def test_steps_are_counted_from_the_last_known_one(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_PROGRESS_EVERY_S", "0")  # every mark, for the test
    with ev.EventLog(tmp_path / "e.jsonl") as log:
        marks = StepMarks(log, SaveCostMeter(log))
        marks.completed(busy=False)  # nothing known yet: not counted
        marks.anchor(41)  # restore() loaded step 41
        for _ in range(3):
            marks.completed(busy=False)  # optimizer.step(): 42, 43, 44
        marks.saving(44, time.monotonic())
        marks.completed(busy=True)  # 45
        marks.completed(busy=False, step=50)  # should_save(50) names it
        marks.completed(busy=False)  # 51
    path = tmp_path / "e.jsonl"
    (first,) = _of(path, ev.FIRST_STEP)
    assert first["step"] == 42 and first["seconds_since_process_start"] > 0
    assert [r["step"] for r in _of(path, ev.PROGRESS)] == [42, 43, 44, 45, 50, 51]


def _readme_loop() -> str:
    (block,) = [b for b in RUN if b.page == "README.md" and b.mark == "run"]
    return block.code


@pytest.mark.slow
def test_the_readme_loop_gets_a_sensible_report_without_a_watchdog(tmp_path: Path) -> None:
    """The README's first loop, as printed, killed once mid-run and restarted: the report
    sees both incarnations' first steps, productive time, the lost work and the restart.
    The kill lands once the loop marked step 35 and the save of step 29 committed (on a
    loaded machine the background write may take longer than six steps): saves are at 29
    and 39, so the restart resumes the last one committed before the kill."""
    code = _readme_loop()
    # the loop as printed, slowed to ~20 ms a step so that a kill lands mid-run
    slow = re.sub(r"(\n(\s+)opt\.step\(\)\n)", r"\n\2import time; time.sleep(0.02)\1", code)
    assert slow != code
    script = tmp_path / "loop.py"
    script.write_text(slow)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TIERCKPT_PROGRESS_EVERY_S": "0"}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env)
    events_path = tmp_path / "ckpt" / "events.jsonl"
    deadline = time.monotonic() + 120
    while not (events_path.exists()
               and any(r.get("step", 0) >= 35 for r in _of(events_path, ev.PROGRESS))
               and any(r.get("step") == 29 for r in _of(events_path, ev.SAVE_COMMITTED))):
        assert time.monotonic() < deadline and proc.poll() is None, "the loop did not save"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    last = max(r["step"] for r in _of(events_path, ev.SAVE_COMMITTED))  # 29, or 39 if late
    subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, check=True,
                   timeout=240)
    recs = ev.read_events(events_path)
    assert len([r for r in recs if r["event"] == ev.FIRST_STEP]) == 2
    g = goodput.account(recs)
    assert g.failures == 1 and len(g.incarnations) == 2
    assert all(v >= 0 for v in g.seconds.values()), g.seconds
    assert g.seconds["productive"] > 0 and 0 < g.goodput < 1
    assert g.seconds["lost_work"] > 0 and g.seconds["restart"] > 0
    assert g.incarnations[1].resumed_from == last, g.incarnations
