"""Loopback TCP ports for the jobs and servers a drill (or the test suite) starts on one
machine, reserved so that two callers never get the same port.

The usual "free port" — bind port 0, read it, close the socket — races: the port goes back to
the kernel's ephemeral range, where the next caller, or any process's outgoing connection,
may take it before the job's store binds it (then the job fails with EADDRINUSE). Here a port
is picked *below* the ephemeral range (the kernel never gives those to an outgoing
connection), must bind right now, and is reserved with a file created exclusively under
:func:`reservations`, so concurrent callers in other processes (test workers, drills) skip
it. A reservation is a claim for the moment between choosing a port and binding it: one
older than :data:`HOLD_S` is stale and may be taken again (by then the job has bound the
port, and the bind check skips it while it is in use).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import time
from pathlib import Path

HOLD_S = 600.0
"""How long a reservation keeps other callers off a port it names."""

_SPAN = 12_000
"""How many ports below the ephemeral range are drawn from."""


def reservations() -> Path:
    """The directory of reservation files (one per port, per user)."""
    return Path(tempfile.gettempdir()) / f"tierckpt-ports-{os.getuid()}"


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (32768 if unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _claim(port: int, where: Path) -> bool:
    """Create the reservation of ``port`` (or take over a stale one); False if held."""
    path = where / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > HOLD_S:
                os.utime(path)  # taken over; a racing taker re-checks the bind below
                return True
    return False


def reserve(n: int = 1, *, tries: int = 2000) -> list[int]:
    """``n`` distinct loopback ports that bind now and that no other caller of this function
    got in the last :data:`HOLD_S` seconds. Raises ``RuntimeError`` when ``tries`` draws
    find too few (a machine with that range in use)."""
    where = reservations()
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    high = _ephemeral_low()
    low = max(1024, high - _SPAN)
    rng = random.Random(time.time_ns() ^ os.getpid())
    out: list[int] = []
    for _ in range(tries):
        port = rng.randrange(low, high)
        if port not in out and _binds(port) and _claim(port, where) and _binds(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {n} free loopback ports in {low}..{high - 1} after {tries} draws "
                       f"(reservations in {where})")


def free_port() -> int:
    """One reserved loopback port (see :func:`reserve`): for ``MASTER_PORT``, a rendezvous
    endpoint or a test server."""
    return reserve(1)[0]
