"""Workers notice that their launcher died and stop (runtime/orphan.py). Real torchrun,
real SIGKILL of only the agent's process group: torchrun puts each worker in a session of
its own, so without the watch they would train on as orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierckpt.runtime import events as ev
from tierckpt.runtime.orphan import watch_launcher

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import os, sys, time
from pathlib import Path

import pytest
import tierckpt
out = Path(sys.argv[1])
tierckpt.init_distributed(event_log=out / "events.jsonl")
(out / f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
while True:  # a training loop that never ends on its own
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has stopped; its reaper is not ours


def _launch(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], list[int]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), str(tmp_path)], env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"pid-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and agent.poll() is None, "workers did not start"
        time.sleep(0.1)
    time.sleep(0.2)  # the pid files are written before the files' contents settle
    return agent, [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_killing_only_the_launcher_stops_every_rank(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TIERCKPT_ORPHANS", None)
    agent, pids = _launch(tmp_path, env)
    assert all(os.getpgid(p) != agent.pid for p in pids)  # their own sessions: orphans-to-be
    os.killpg(agent.pid, signal.SIGKILL)  # only the launcher's process group
    agent.wait()
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"ranks outlived their launcher: {pids}"
        time.sleep(0.2)
    lost = [r for r in ev.read_events(tmp_path / "events.jsonl")
            if r["event"] == ev.LAUNCHER_LOST]
    assert sorted(r["rank"] for r in lost) == [0, 1]
    assert {r["parent_pid"] for r in lost} == {agent.pid}


def test_the_watch_is_off_outside_torchrun_and_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_launcher() is None  # not under torchrun: no launcher to lose
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TIERCKPT_ORPHANS", "keep")
    assert watch_launcher() is None
