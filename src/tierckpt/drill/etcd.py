"""A private one-member etcd on loopback for a drill that was given no ``--etcd``: the
``etcd`` binary on PATH (Debian's ``etcd-server``), its data under the drill's directory,
stopped when the drill ends. A drill's job store only; a real job's etcd is the cluster's
(docs/heal.md)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tierckpt._ports import reserve
from tierckpt.errors import ConfigError
from tierckpt.runtime.nodespec import member_health

__all__ = ["private_etcd"]

READY_S = 30.0


@contextlib.contextmanager
def private_etcd(workdir: Path) -> Iterator[str]:
    """Start etcd with its data and log in ``workdir``; yield its ``etcd://`` endpoint once
    it answers healthy; stop it (SIGTERM, then SIGKILL after 5 s) on exit. ConfigError
    when no ``etcd`` is on PATH or it does not become healthy within :data:`READY_S`."""
    exe = shutil.which("etcd")
    if exe is None:
        raise ConfigError("the node drill needs the job's etcd: give --etcd "
                          "etcd://host:port, or install etcd (Debian: etcd-server) so that "
                          "the drill starts its own")
    workdir.mkdir(parents=True, exist_ok=True)
    client, peer = reserve(2)
    c_url, p_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with open(workdir / "etcd.log", "ab") as log:
        proc = subprocess.Popen(
            [exe, "--name", "drill", "--data-dir", str(workdir / "data"),
             "--listen-client-urls", c_url, "--advertise-client-urls", c_url,
             "--listen-peer-urls", p_url, "--initial-advertise-peer-urls", p_url,
             "--initial-cluster", f"drill={p_url}", "--heartbeat-interval", "25",
             "--election-timeout", "250"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + READY_S
        while member_health(c_url, 1.0) is not None:
            if proc.poll() is not None or time.monotonic() > end:
                raise ConfigError(f"the drill's etcd did not start (exit {proc.poll()}); "
                                  f"see {workdir / 'etcd.log'}")
            time.sleep(0.1)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
