"""examples/train.py, the reference user: killed with SIGKILL under torchrun, it resumes and
its losses continue bit-identically; its events record the whole restart timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._references import EXAMPLE, EXAMPLE_SMALL, EXAMPLE_STEPS
from tierckpt.policy import goodput
from tierckpt.runtime.events import read_events

SMALL = EXAMPLE_SMALL  # the settings of the session's example_reference (tests/conftest.py)
STEPS = EXAMPLE_STEPS  # saves after steps 4, 9, 14, 19, 23


def _train(tmp: Path, name: str, *extra: str, restarts: int = 0) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TIERCKPT_PROGRESS_EVERY_S="0")  # a progress mark per step
    losses = tmp / f"{name}.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(EXAMPLE),
         "--tier1", str(tmp / name), "--losses", str(losses), *SMALL, *extra],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in losses.read_text().splitlines()]


@pytest.mark.slow
def test_killed_run_resumes_bit_identical_with_restart_timeline(
        tmp_path: Path, example_reference: dict[int, dict[str, Any]]) -> None:
    ref = example_reference
    assert sorted(ref) == list(range(STEPS))
    assert ref[STEPS - 1]["loss"] < ref[0]["loss"]  # it learns

    rows = _train(tmp_path, "kill", "--kill-at", "8", "--kill-rank", "1", restarts=1)
    first = [r for r in rows if r["attempt"] == 0]
    after = [r for r in rows if r["attempt"] == 1]
    assert [r["step"] for r in first] == list(range(9))
    # The newest checkpoint before the kill is step 4 (saves after steps 4 and 9).
    assert [r["step"] for r in after] == list(range(5, STEPS))
    for r in rows:
        assert r["loss_hex"] == ref[r["step"]]["loss_hex"], r["step"]
        assert r["lr"] == ref[r["step"]]["lr"]

    events = read_events(tmp_path / "kill" / "events.jsonl")
    timeline = [e["event"] for e in events if e["rank"] == 0 and e["event"] in (
        "process_start", "pg_ready", "checkpoint_chosen", "state_loaded", "first_step")]
    fresh = ["process_start", "pg_ready", "checkpoint_chosen", "first_step"]
    resumed = ["process_start", "pg_ready", "checkpoint_chosen", "state_loaded", "first_step"]
    assert timeline == [*fresh, *resumed]
    restarted = [e for e in events if e["event"] == "process_start"]
    assert sorted(e["restart_count"] for e in restarted) == [0, 0, 1, 1]
    firsts = [e for e in events if e["event"] == "first_step" and e["rank"] == 0]
    assert [e["step"] for e in firsts] == [0, 5]

    # the goodput report of the same run: the parts sum to the wall time, and the lost work
    # is the 4 steps the resume threw away (5 to 8) at the killed incarnation's own seconds
    # per step (its training span over the 8 steps it ran). No step time is predicted: they
    # vary 2x within a run on a shared box, so the bound below is timing-free.
    g = goodput.account(events)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    killed, later = g.incarnations
    assert (killed.first_step, killed.last_step, later.resumed_from, g.failures) == (0, 8, 4, 1)
    assert killed.first_step_t is not None
    end = killed.end if killed.failure_t is None else min(killed.end, killed.failure_t)
    per_step = (end - killed.first_step_t) / 8
    assert g.seconds["lost_work"] == pytest.approx(4 * per_step)
    # and the span holds every progress mark inside it, so the lost half of it is at least
    # half the time between the first and the last of those marks
    marks = [e["t"] for e in events if e["event"] == "progress" and e["pid"] == killed.pid
             and killed.first_step_t <= e["t"] <= end]
    assert len(marks) >= 2
    assert g.seconds["lost_work"] >= (max(marks) - min(marks)) / 2
    assert g.seconds["restart"] > 0 and g.seconds["productive"] > 0
