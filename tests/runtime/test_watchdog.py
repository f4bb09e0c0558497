"""StepWatchdog: a rank that stops stepping is dumped, reported and ended non-zero.

The firing paths run in child processes (the watchdog ends its process with os._exit); the
torchrun case proves the whole story: a real hang inside a gloo all_reduce becomes an exit
that torchrun restarts, and the restarted job finishes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.errors import ConfigError
from tierckpt.runtime.events import read_events
from tierckpt.runtime.watchdog import EXIT_CODE, StepWatchdog

SCRIPT = Path(__file__).parents[1] / "scripts" / "hang_worker.py"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_hung_process_dumps_stacks_emits_events_and_exits_nonzero(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    proc = _run([str(SCRIPT), "--mode", "single", "--events", str(events),
                 "--hang-timeout", "1"], timeout=60)
    assert proc.returncode == EXIT_CODE, proc.stderr
    # faulthandler's dump of every thread names the frame the main thread is stuck in.
    assert "_stuck_in_data_loader" in proc.stderr
    assert "tierckpt-step-watchdog" in proc.stderr or "Thread 0x" in proc.stderr
    recs = read_events(events)
    hang = [r for r in recs if r["event"] == "hang_detected"]
    failure = [r for r in recs if r["event"] == "failure_detected"]
    assert len(hang) == 1 and len(failure) == 1
    assert hang[0]["step"] == 2 and hang[0]["seconds_without_step"] >= 1.0
    assert failure[0]["how"] == "watchdog" and failure[0]["step"] == 2
    first = [r for r in recs if r["event"] == "first_step"]
    assert len(first) == 1 and first[0]["step"] == 0
    assert first[0]["seconds_since_process_start"] > 0
    stacks = Path(hang[0]["stacks"])
    assert stacks.parent == tmp_path and "_stuck_in_data_loader" in stacks.read_text()


@pytest.mark.slow
def test_steady_steps_never_fire(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    proc = _run([str(SCRIPT), "--mode", "steady", "--events", str(events),
                 "--hang-timeout", "30"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [r for r in read_events(events) if r["event"] in ("hang_detected",
                                                              "failure_detected")] == []


@pytest.mark.slow
def test_hang_in_collective_is_restarted_by_torchrun(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "--max-restarts", "1", "--monitor-interval", "0.1", str(SCRIPT),
                 "--mode", "torchrun", "--events", str(events), "--hang-timeout", "2"],
                timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = read_events(events)
    hangs = {r["rank"]: r for r in recs if r["event"] == "hang_detected"}
    # Rank 1 stopped stepping after step 2; rank 0 was blocked in all_reduce of step 3.
    assert hangs[1]["step"] == 2
    assert hangs[0]["step"] == 2
    rank0_stacks = Path(hangs[0]["stacks"]).read_text()
    assert "all_reduce" in rank0_stacks
    starts = sorted(r["restart_count"] for r in recs if r["event"] == "process_start")
    assert starts == [0, 0, 1, 1]
    assert f"failed (exitcode: {EXIT_CODE})" in proc.stderr


def test_close_is_idempotent_and_joins() -> None:
    wd = StepWatchdog(60.0)
    with wd:
        wd.step_completed(0)
        assert wd.last_step == 0
        thread = wd._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()
    wd.close()
    with pytest.raises(ConfigError):
        wd.start()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "10", True, None])
def test_bad_hang_timeout_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="hang_timeout"):
        StepWatchdog(bad)  # type: ignore[arg-type]


def test_bad_exit_code_and_log_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="exit_code"):
        StepWatchdog(1.0, exit_code=0)
    with pytest.raises(ConfigError, match="event_log"):
        StepWatchdog(1.0, event_log=42)  # type: ignore[arg-type]
