"""Real torchrun jobs (2 gloo ranks, examples/train.py) preempted at Hypothesis-chosen steps
and phases: a signal to one rank, SIGUSR1, the same notice twice, SIGTERM to the torchrun
agent (which forwards it to every worker), and a notice while a background save is in
flight. Each run checks: every rank stopped at the same step; that step's checkpoint is
complete and verifies; lost work is at most one step (the saved step is at or after the
notice's); after the restart the losses are bit-identical to a run never interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._launch import read_jsonl
from tests._references import EXAMPLE, EXAMPLE_SAVE_EVERY, EXAMPLE_SMALL, EXAMPLE_STEPS
from tierckpt.format import layout
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime.events import read_events
from tierckpt.tier1.manifests import read_committed

STEPS, EVERY = EXAMPLE_STEPS, EXAMPLE_SAVE_EVERY
SMALL = EXAMPLE_SMALL  # the settings of the session's example_reference (tests/conftest.py)
pytestmark = pytest.mark.slow


def _cmd(root: Path, losses: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "--max-restarts", "0", "--monitor-interval", "0.1",
            str(EXAMPLE), "--tier1", str(root), "--losses", str(losses), *SMALL, *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _run(root: Path, losses: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(root, losses, *extra), env=_env(), capture_output=True,
                          text=True, timeout=240)


@pytest.fixture(scope="module")
def reference(example_reference: dict[int, dict[str, Any]]) -> dict[int, str]:
    """The uninterrupted run's loss bits per step (the session's example_reference)."""
    return {step: row["loss_hex"] for step, row in example_reference.items()}


def _signal_agent_at(root: Path, losses: Path, step: int) -> tuple[int, int]:
    """Run the job; SIGTERM the torchrun agent once rank 0 logged ``step``. Returns the
    agent's exit status and the newest step logged when the signal was sent."""
    proc = subprocess.Popen(_cmd(root, losses), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen = -1
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        rows = read_jsonl(losses) if losses.exists() else []
        seen = max((r["step"] for r in rows), default=-1)
        if seen >= step:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    proc.communicate(timeout=120)
    return proc.returncode, seen


def _check(root: Path, losses: Path, ref: dict[int, str], notice_step: int) -> int:
    stops = [e for e in read_events(root / layout.EVENTS) if e["event"] == "preempt_stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1], stops
    [target] = {e["step"] for e in stops}
    assert notice_step <= target <= notice_step + 2, (notice_step, target)
    committed = read_committed(root / layout.step_dirname(target), step=target)
    assert committed.manifest.step == target
    saved = [e for e in read_events(root / layout.EVENTS) if e["event"] == "preempt_saved"]
    assert {e["step"] for e in saved} == {target} and all("tier1" in e["reached"] for e in saved)
    first = read_jsonl(losses)
    assert max(r["step"] for r in first) == target  # nobody trained past the agreed step
    again = _run(root, losses)
    assert again.returncode == 0, again.stderr[-4000:]
    rows = read_jsonl(losses)
    resumed = [r["step"] for r in rows[len(first):]]
    assert resumed == list(range(target + 1, STEPS))  # lost work: none
    for r in rows:
        assert r["loss_hex"] == ref[r["step"]], r["step"]
    return target


PHASES = ("rank0", "rank1", "usr1", "in_save", "agent")


@pytest.mark.timeout(900)  # four jobs of ~25 s; a CI with a load of 12 took over 300 s
@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(phase=st.sampled_from(PHASES), at=st.integers(2, 15))
def test_a_notice_at_any_step_stops_every_rank_at_one_step_and_loses_nothing(
        tmp_path_factory: pytest.TempPathFactory, reference: dict[int, str], phase: str,
        at: int) -> None:
    tmp = tmp_path_factory.mktemp(f"{phase}-{at}")
    root, losses = tmp / "t1", tmp / "losses.jsonl"
    if phase == "agent":
        code, seen = _signal_agent_at(root, losses, at)
        assert code != 0  # torchrun itself was told to stop
        at = seen
    else:
        if phase == "in_save":  # right after a save step: that save is still being written
            at = (at // EVERY) * EVERY + EVERY - 1
        extra: list[str] = ["--notice-at", str(at),
                            "--notice-rank", "1" if phase == "rank1" else "0"]
        if phase == "usr1":
            extra += ["--notice-signal", "SIGUSR1"]
        proc = _run(root, losses, *extra)
        assert f"exitcode  : {EXIT_PREEMPTED}" in proc.stderr, proc.stderr[-4000:]
    _check(root, losses, reference, at)


def test_sigkill_after_the_notice_loses_nothing_committed(
        tmp_path: Path, reference: dict[int, str]) -> None:
    """A notice, then SIGKILL of every worker before the emergency save can commit: the
    restart resumes from the newest complete checkpoint, and the losses still match."""
    root, losses = tmp_path / "t1", tmp_path / "losses.jsonl"
    proc = subprocess.Popen(_cmd(root, losses), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    def complete() -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")
                      if (p / layout.COMPLETE).exists())

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # a committed save (async: it may lag the steps)
        if complete() and losses.exists() and any(r["step"] >= 7 for r in read_jsonl(losses)):
            break
        time.sleep(0.02)
    before = complete()
    assert before, "no save committed before the notice"
    os.killpg(proc.pid, signal.SIGTERM)  # the notice, to the agent and the workers
    os.killpg(proc.pid, signal.SIGKILL)  # and the hard kill right behind it
    proc.wait(timeout=60)
    assert set(before) <= set(complete())  # nothing committed was lost
    again = _run(root, losses)
    assert again.returncode == 0, again.stderr[-4000:]
    rows = read_jsonl(losses)
    for r in rows:
        assert r["loss_hex"] == reference[r["step"]], r["step"]
    assert rows[-1]["step"] == STEPS - 1
