"""Reserved loopback ports (tierckpt._ports): distinct across concurrent processes,
below the ephemeral range, bindable, and a stale reservation is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tierckpt import _ports as ports


@pytest.fixture
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Reservations under this test's own temp dir (other runs' reservations stay apart)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return tmp_path


def test_reserved_ports_are_distinct_bindable_and_below_the_ephemeral_range(
        own_tmp: Path) -> None:
    got = ports.reserve(8)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert len(set(got)) == 8
    assert all(1024 <= p < low for p in got)
    assert sorted(int(f.name) for f in ports.reservations().iterdir()) == sorted(got)
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free now: nothing of ours holds it


_CHILD = ("import json, sys; from tierckpt import _ports as ports; "
          "print(json.dumps(ports.reserve(int(sys.argv[1]))))")


def test_concurrent_processes_never_get_the_same_port(own_tmp: Path) -> None:
    # 8 x 30 draws from ~12k ports collide about twice without the reservations
    env = {**os.environ, "TMPDIR": str(own_tmp)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, "30"], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(8)]
    got = [p for proc in procs for p in json.loads(proc.communicate(timeout=60)[0])]
    assert len(got) == 240 and len(set(got)) == 240


def _held_port_with_a_free_neighbour(held: socket.socket) -> int:
    """Bind ``held`` to a port whose next port binds right now (the kernel's port 0 is in
    the ephemeral range, where another process's connection may hold the neighbour: CI
    once drew 40107 with 40108 in use by another lane)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            busy = probe.getsockname()[1]
        if ports._binds(busy + 1):
            try:
                held.bind(("127.0.0.1", busy))
            except OSError:
                continue
            return busy
    raise AssertionError("no port with a free neighbour in 200 draws")


def test_a_port_in_use_is_skipped(own_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        busy = _held_port_with_a_free_neighbour(held)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: busy + 2)
        monkeypatch.setattr(ports, "_SPAN", 2)  # draws from {busy, busy + 1}
        assert ports.reserve(1) == [busy + 1]
        with pytest.raises(RuntimeError, match="no 1 free loopback ports"):
            ports.reserve(1, tries=50)  # busy is bound, busy + 1 reserved


def test_a_stale_reservation_is_taken_over_a_fresh_one_is_not(own_tmp: Path) -> None:
    where = ports.reservations()
    where.mkdir()
    assert ports._claim(40000, where) and not ports._claim(40000, where)
    old = time.time() - ports.HOLD_S - 5
    os.utime(where / "40000", (old, old))
    assert ports._claim(40000, where)
    assert time.time() - (where / "40000").stat().st_mtime < 5  # renewed for this caller
