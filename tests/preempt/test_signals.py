"""Notice signals: a script that never opted in keeps the old behaviour (the default action
or its previous handler), and an armed one records the notice and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tierckpt.preempt.notice import NoticeBox
from tierckpt.preempt.signals import SignalNotices

CHILD = Path(__file__).parent / "scripts" / "signal_child.py"


def _child(mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, str(CHILD), mode], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    return p


def test_before_arming_sigterm_still_ends_the_process() -> None:
    p = _child("plain")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM  # the default action, not a hang


def test_before_arming_the_previous_python_handler_runs() -> None:
    p = _child("previous")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 3 and "PREVIOUS" in out


def test_armed_signals_are_recorded_once_each_and_the_first_is_kept() -> None:
    p = _child("armed")
    p.send_signal(signal.SIGUSR1)
    assert p.stdout is not None
    p.send_signal(signal.SIGTERM)  # a second notice (Slurm and torchrun both forward)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    source, posted, grace = out.split()[1:4]
    assert posted == "2" and float(grace) == 7.0
    assert source in ("signal:SIGUSR1", "signal:SIGTERM")


def test_uninstall_puts_the_previous_handlers_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    n = SignalNotices(NoticeBox(), (int(signal.SIGUSR1),), grace_s=1.0)
    assert n.install() and signal.getsignal(signal.SIGUSR1) == n._on_signal
    n.armed = True
    os.kill(os.getpid(), signal.SIGUSR1)
    assert n.box.first is not None and n.box.first.source == "signal:SIGUSR1"
    n.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_off_the_main_thread_nothing_is_installed() -> None:
    n = SignalNotices(NoticeBox(), (int(signal.SIGUSR1),), grace_s=1.0)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(n.install()))
    t.start()
    t.join()
    assert got == [False] and not n.installed
