"""The grace a notice gets when ``Preemption(grace_s=None)``: from the launcher
(``TIERCKPT_GRACE_S``) or the scheduler (Slurm: the ``--signal`` lead for its signal, the
partition's ``GraceTime`` for SIGTERM), else 30 s; a number in the config wins. Resolved on
values, then seen in a real single-process loop (tests/preempt/scripts/loop.py) whose
``preempt_notice`` deadline is its receipt plus that grace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.test_scheduler import fake_scontrol, job_env
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.preempt.config import DEFAULT_GRACE_S, EXIT_PREEMPTED, Preemption
from tierckpt.preempt.session import resolve_grace
from tierckpt.runtime.events import read_events

LOOP = Path(__file__).parent / "scripts" / "loop.py"


def test_the_config_wins_then_the_launcher_then_the_default() -> None:
    launcher = {"TIERCKPT_GRACE_S": "12"}
    assert resolve_grace(Preemption(grace_s=5.0), launcher).seconds == 5.0
    assert resolve_grace(Preemption(), launcher).seconds == 12.0
    g = resolve_grace(Preemption(), {})
    assert (g.seconds, g.by_signal) == (DEFAULT_GRACE_S, ())
    assert Preemption().grace_s is None  # "from the scheduler", not a number


def test_a_bad_launcher_grace_fails_at_start() -> None:
    with pytest.raises(ConfigError, match="TIERCKPT_GRACE_S"):
        resolve_grace(Preemption(), {"TIERCKPT_GRACE_S": "later"})
    with pytest.raises(ConfigError, match="grace_s"):
        Preemption(grace_s=0)


def _notice_grace(root: Path, sig: str, env: dict[str, str]) -> float:
    """Run the loop with a ``sig`` notice at step 3; the grace its notice got (deadline -
    receipt), after checking the loop stopped, saved and exited 75."""
    p = subprocess.run([sys.executable, str(LOOP), str(root), "--steps", "8", "--notice-at",
                        "3", "--signal", sig], env=job_env(**env), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == EXIT_PREEMPTED, p.stderr
    [notice] = [e for e in read_events(root / layout.EVENTS) if e["event"] == "preempt_notice"]
    assert notice["source"] == f"signal:{sig}"
    return round(notice["deadline_unix"] - notice["received_unix"], 3)


@pytest.mark.parametrize(("sig", "want"), [("SIGUSR1", 45.0), ("SIGTERM", 20.0)])
def test_under_slurm_each_signal_gets_its_own_grace(tmp_path: Path, sig: str,
                                                    want: float) -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_PARTITION": "low",
           "PATH": fake_scontrol(tmp_path)}
    assert _notice_grace(tmp_path / "t1", sig, env) == want


def test_under_kubernetes_the_manifests_grace_holds(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "TIERCKPT_GRACE_S": "63"}
    assert _notice_grace(tmp_path / "t1", "SIGTERM", env) == 63.0


def test_elsewhere_the_default(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "")}
    assert _notice_grace(tmp_path / "t1", "SIGTERM", env) == DEFAULT_GRACE_S
