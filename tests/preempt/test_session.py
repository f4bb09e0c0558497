"""The loop contract in one process: a notice makes ``should_save`` and ``should_stop`` True
at the agreed step, the save is carried as far as the grace allows, ``close()`` exits with
75 and the restart continues from the saved step; a script that never opted in still dies
on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt import Preemption, Tier0, Tier2
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime.events import read_events
from tierckpt.tier1.catalog import Tier1Catalog

LOOP = Path(__file__).parent / "scripts" / "loop.py"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(LOOP), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _steps(out: str) -> dict[int, str]:
    return {int(w[1]): w[2] for w in (line.split() for line in out.splitlines())
            if w and w[0] == "STEP"}


def _kinds(root: Path, kind: str) -> list[dict]:
    return [e for e in read_events(root / layout.EVENTS) if e["event"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The loop's 16 steps uninterrupted: step → loss, for both notices' runs."""
    return _steps(_run(str(tmp_path_factory.mktemp("ref") / "ref"), "--steps", "16").stdout)


@pytest.mark.slow  # two runs and their restarts, 15 s: out of make test-fast
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_notice_saves_the_step_exits_75_and_the_restart_loses_nothing(
        tmp_path: Path, sig: str, reference: dict[int, str]) -> None:
    ref = reference
    root = tmp_path / "run"
    first = _run(str(root), "--steps", "16", "--notice-at", "6", "--signal", sig)
    assert first.returncode == EXIT_PREEMPTED, first.stderr
    assert max(_steps(first.stdout)) == 6 and "END" not in first.stdout
    [stop] = _kinds(root, "preempt_stop")
    assert stop["step"] == 6 and stop["source"] == f"signal:{sig}"
    [saved] = _kinds(root, "preempt_saved")
    assert saved["reached"] == ["tier1"] and saved["abandoned"] == {}
    assert [e["code"] for e in _kinds(root, "preempt_exit")] == [EXIT_PREEMPTED]
    assert (root / layout.step_dirname(6) / layout.COMPLETE).exists()

    again = _run(str(root), "--steps", "16")
    assert again.returncode == 0, again.stderr
    resumed = _steps(again.stdout)
    assert min(resumed) == 7  # nothing lost, nothing redone
    for step, loss in {**_steps(first.stdout), **resumed}.items():
        assert loss == ref[step], step


def test_a_script_that_never_calls_should_stop_still_dies_on_sigterm(tmp_path: Path) -> None:
    proc = _run(str(tmp_path / "run"), "--notice-at", "3", "--no-stop")
    assert proc.returncode == -signal.SIGTERM
    assert _steps(proc.stdout) and max(_steps(proc.stdout)) == 3


def test_signals_are_left_alone_until_should_stop_arms_them(tmp_path: Path) -> None:
    # an installed Python handler would defer SIGTERM while the main thread is blocked in a
    # collective; left alone, the kernel's default action ends the process at once
    before = signal.getsignal(signal.SIGTERM)
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1",
                                    preemption=Preemption(exit_code=None)) as ckpt:
        assert signal.getsignal(signal.SIGTERM) == before
        assert not ckpt.should_stop(0)
        assert signal.getsignal(signal.SIGTERM) != before  # armed: a notice from now on
    assert signal.getsignal(signal.SIGTERM) == before


def _loop(ckpt: tierckpt.CheckpointManager, state: tierckpt.TrainState, *, notice_at: int,
          save: bool = True, steps: int = 20) -> int | None:
    model = state.model
    assert isinstance(model, torch.nn.Module) and state.optimizer is not None
    ckpt.restore(state)
    for step in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        state.optimizer.step()
        if step == notice_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if save and ckpt.should_save(step):
            ckpt.save(step, state)
        if ckpt.should_stop(step):
            return step
    return None


def _state() -> tierckpt.TrainState:
    model = torch.nn.Linear(4, 4)
    return tierckpt.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1))


def test_should_stop_saves_the_step_itself_when_the_loop_did_not(tmp_path: Path) -> None:
    ckpt = tierckpt.CheckpointManager(tier1=tmp_path / "t1",
                                      preemption=Preemption(exit_code=None))
    try:
        assert _loop(ckpt, _state(), notice_at=4, save=False) == 4
        assert ckpt.last_committed == 4
        assert ckpt.should_stop(5)  # stays True once stopped
    finally:
        ckpt.close()  # exit_code=None: returns


def test_close_raises_system_exit_with_the_configured_code(tmp_path: Path) -> None:
    ckpt = tierckpt.CheckpointManager(tier1=tmp_path / "t1", preemption=Preemption(exit_code=9))
    assert _loop(ckpt, _state(), notice_at=2) == 2
    with pytest.raises(SystemExit) as info:
        ckpt.close()
    assert info.value.code == 9


def test_should_stop_without_any_state_says_what_to_call(tmp_path: Path) -> None:
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1",
                                    preemption=Preemption(exit_code=None)) as ckpt:
        assert not ckpt.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(ConfigError, match=r"restore\(state\) or save"):
            ckpt.should_stop(1)


def test_a_ram_save_is_carried_to_tier1_and_tier2(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    root = tmp_path / "t1"
    with pytest.raises(SystemExit), tierckpt.CheckpointManager(
            tier1=root, tier0=Tier0(tmp_path / "shm", tier1_every=1000),
            tier2=Tier2(f"file://{bucket}", upload_every=1000)) as ckpt:
        assert _loop(ckpt, _state(), notice_at=5) == 5
        assert ckpt.last_committed == 5
    [saved] = _kinds(root, "preempt_saved")
    assert saved["reached"] == ["tier0", "tier1", "tier2"], saved
    assert (root / layout.step_dirname(5) / layout.COMPLETE).exists()
    assert list(bucket.rglob(f"*{layout.step_dirname(5)}*")), "tier 2 holds the step"
    assert Tier1Catalog(root).pins() == {}  # the request is dropped once done


def test_a_tier2_copy_the_grace_cannot_fit_is_abandoned_and_named(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    root = tmp_path / "t1"
    with pytest.raises(SystemExit), tierckpt.CheckpointManager(
            tier1=root, tier2=Tier2(f"file://{bucket}", upload_every=1000),
            preemption=Preemption(grace_s=1.0, margin_s=1.0)) as ckpt:
        t0 = time.monotonic()
        assert _loop(ckpt, _state(), notice_at=3) == 3
    [saved] = _kinds(root, "preempt_saved")
    assert saved["reached"] == ["tier1"]
    assert "tier2" in saved["abandoned"] and "grace" in saved["abandoned"]["tier2"]
    assert not list(bucket.rglob(f"*{layout.step_dirname(3)}*"))
    assert time.monotonic() - t0 < 60  # no drain waited for a copy that could not fit


def test_a_trigger_file_is_a_notice_and_one_left_from_before_is_not(tmp_path: Path) -> None:
    stale = tmp_path / "stale-stop"
    stale.write_text("")
    os.utime(stale, (1.0, 1.0))  # written long before this process started
    trigger = tmp_path / "stop"
    state = _state()
    model, opt = state.model, state.optimizer
    assert isinstance(model, torch.nn.Module) and opt is not None
    with tierckpt.CheckpointManager(
            tier1=tmp_path / "old", preemption=Preemption(trigger_file=stale,
                                                          exit_code=None)) as ckpt:
        ckpt.restore(state)
        for step in range(30):
            assert not ckpt.should_stop(step)
            time.sleep(0.02)  # the watcher polls it: 0.6 s of chances
    with tierckpt.CheckpointManager(
            tier1=tmp_path / "t1", preemption=Preemption(trigger_file=trigger,
                                                         exit_code=None)) as ckpt:
        ckpt.restore(state)
        stopped = None
        for step in range(10_000):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            if step == 3:
                trigger.write_text("12")  # 12 s of grace left, from the file's mtime
            if ckpt.should_stop(step):
                stopped = step
                break
            time.sleep(0.005)
    assert stopped is not None and stopped >= 3
    [notice] = _kinds(tmp_path / "t1", "preempt_notice")
    assert notice["source"] == f"file:{trigger}"
    assert 2 <= notice["step"] <= stopped  # where the loop was when the watcher saw the file
    assert abs(notice["deadline_unix"] - trigger.stat().st_mtime - 12) < 1e-3


@pytest.mark.slow
def test_a_tier2_too_slow_for_the_grace_is_cut_off_without_a_marker(
        tmp_path: Path, s3_env: Any, fault_proxy: Any) -> None:
    """No upload rate is measured yet, so the carry tries tier 2; the server answers every
    PUT only after the deadline. The drain ends with the grace, the uploader is stopped, no
    marker is written, and the process still exits 75 before the deadline."""
    root = tmp_path / "t1"
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as info, tierckpt.CheckpointManager(
            tier1=root, tier2=Tier2(s3_env.url, upload_every=1000),
            preemption=Preemption(grace_s=8.0, margin_s=2.0)) as ckpt:
        fault_proxy.add_rule("delay", method="PUT", hang_s=60.0, times=None)  # after the probe
        assert _loop(ckpt, _state(), notice_at=3) == 3
    took = time.monotonic() - t0
    assert info.value.code == EXIT_PREEMPTED
    [saved] = _kinds(root, "preempt_saved")
    assert saved["reached"] == ["tier1"], saved
    assert "did not finish" in saved["abandoned"]["tier2"], saved
    assert not [k for k in s3_env.keys() if layout.step_dirname(3) in k  # noqa: SIM118
                and k.endswith(layout.COMPLETE)]
    assert took < 30  # the grace bounded the close (not the uploader's 60 s stop grace)
