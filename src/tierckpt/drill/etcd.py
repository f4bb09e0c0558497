"""A private etcd on loopback for a drill that was given no ``--etcd``: one member, or three
when a fault loses one (``store_node``), the ``etcd`` binary on PATH (Debian's
``etcd-server``), its data under the drill's directory, stopped when the drill ends. A
drill's job store only; a real job's etcd is the cluster's (docs/heal.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tierckpt._ports import reserve
from tierckpt.errors import ConfigError
from tierckpt.runtime.nodespec import member_health

__all__ = ["PrivateEtcd", "private_etcd"]

READY_S = 30.0


@dataclasses.dataclass
class PrivateEtcd:
    """The drill's etcd: ``endpoint`` (``etcd://h:p[,h:p...]``, every member) and each
    member's process, member i named ``m<i>``."""

    endpoint: str
    procs: list[subprocess.Popen[bytes]]

    def kill(self, member: int) -> None:
        """SIGKILL member ``member`` (its node is lost); the others keep a quorum of 3."""
        self.procs[member].kill()
        self.procs[member].wait()

    def alive(self, member: int) -> bool:
        return self.procs[member].poll() is None


@contextlib.contextmanager
def private_etcd(workdir: Path, members: int = 1) -> Iterator[PrivateEtcd]:
    """Start ``members`` etcd members with their data and logs in ``workdir``; yield them
    once every member answers healthy; stop them (SIGTERM, then SIGKILL after 5 s) on exit.
    ConfigError when no ``etcd`` is on PATH or a member does not become healthy within
    :data:`READY_S`."""
    exe = shutil.which("etcd")
    if exe is None:
        raise ConfigError("the node drill needs the job's etcd: give --etcd "
                          "etcd://host:port, or install etcd (Debian: etcd-server) so that "
                          "the drill starts its own")
    workdir.mkdir(parents=True, exist_ok=True)
    ports = reserve(2 * members)
    clients = [f"http://127.0.0.1:{p}" for p in ports[:members]]
    peers = [f"http://127.0.0.1:{p}" for p in ports[members:]]
    cluster = ",".join(f"m{i}={p}" for i, p in enumerate(peers))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(members):
            with open(workdir / f"etcd-m{i}.log", "ab") as log:
                procs.append(subprocess.Popen(
                    [exe, "--name", f"m{i}", "--data-dir", str(workdir / f"data-m{i}"),
                     "--listen-client-urls", clients[i], "--advertise-client-urls",
                     clients[i], "--listen-peer-urls", peers[i],
                     "--initial-advertise-peer-urls", peers[i], "--initial-cluster", cluster,
                     "--heartbeat-interval", "25", "--election-timeout", "250"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        end = time.monotonic() + READY_S
        for i, url in enumerate(clients):
            while member_health(url, 1.0) is not None:
                if procs[i].poll() is not None or time.monotonic() > end:
                    raise ConfigError(f"the drill's etcd did not start (member m{i} exit "
                                      f"{procs[i].poll()}); see {workdir / f'etcd-m{i}.log'}")
                time.sleep(0.1)
        yield PrivateEtcd("etcd://" + ",".join(u.removeprefix("http://") for u in clients),
                          procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
