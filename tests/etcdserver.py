"""pytest plugin: etcd on loopback, the job store of a heal across nodes (issue 43).

The server is Debian's ``etcd-server`` (etcd 3.4; ``.ci/run`` installs it). We start the
binary ourselves, without systemd: each member on 127.0.0.1 with its own free client and peer
ports and a data directory under the test's tmp, with fast raft timers (25 ms heartbeat,
250 ms election) so that a cluster that lost its leader elects another within a few hundred
milliseconds.

Fixtures (registered from tests/conftest.py):

- ``etcd_server`` (session): a one-member :class:`EtcdCluster`, shared; a test isolates its
  keys with a fresh job id (:func:`job_id`). Never kill it.
- ``etcd_cluster`` (function): a factory, ``etcd_cluster(members=1)``, for a private cluster
  that the test may kill and restart (:meth:`EtcdCluster.kill`, :meth:`EtcdCluster.restart`);
  every cluster it started is stopped after the test.

A missing ``etcd`` skips (fails under ``CI=true``: :func:`tests._require.require`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests._require import require
from tierckpt._ports import reserve

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
MISSING = "etcd is missing (apt-get install etcd-server)"


def etcd_binary() -> str | None:
    """The ``etcd`` executable on PATH, or None."""
    return shutil.which("etcd")


def job_id() -> str:
    """A job id no other test uses (the store's keys live under ``/tierckpt/<job id>/``)."""
    return f"t-{uuid.uuid4().hex[:12]}"


@dataclasses.dataclass
class EtcdMember:
    """One member: its name, ports, data directory and log, and its process while it runs."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its client URL, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def healthy(self) -> bool:
        """Whether it answers ``/health`` with ``true`` (it is a member of a cluster that has
        a leader)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False


@dataclasses.dataclass
class EtcdCluster:
    """Members on loopback that form one etcd cluster. ``endpoints`` is what
    :class:`tierckpt.runtime.etcdstore.EtcdStore` takes: every client URL, comma-separated."""

    members: list[EtcdMember]
    initial_cluster: str
    flags: tuple[str, ...] = ()
    """More etcd flags for every member (``--quota-backend-bytes N``...)."""

    @property
    def endpoints(self) -> str:
        return ",".join(m.url for m in self.members)

    @property
    def url(self) -> str:
        """The first member's client URL."""
        return self.members[0].url

    def start(self, i: int, *, state: str = "existing") -> None:
        """Start member ``i`` on its ports and data directory (``state``: ``new`` the first
        time, ``existing`` to restart it on the data it kept). Returns at once; see
        :meth:`wait_healthy`."""
        m = self.members[i]
        m.data_dir.mkdir(parents=True, exist_ok=True)
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(
                [etcd_binary() or "etcd", "--name", m.name, "--data-dir", str(m.data_dir),
                 "--listen-client-urls", m.url, "--advertise-client-urls", m.url,
                 "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                 "--initial-cluster", self.initial_cluster, "--initial-cluster-state", state,
                 "--initial-cluster-token", "tierckpt-test",
                 "--heartbeat-interval", "25", "--election-timeout", "250",
                 "--logger", "zap", "--log-level", "warn", *self.flags],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def wait_healthy(self, *indices: int) -> None:
        """Wait until members ``indices`` (every running one by default) answer healthy;
        RuntimeError with the tail of a log when one does not within READY_TIMEOUT_S."""
        todo = [self.members[i] for i in indices] if indices else [
            m for m in self.members if m.proc is not None]
        deadline = time.monotonic() + READY_TIMEOUT_S
        for m in todo:
            while not m.healthy():
                exited = m.proc is not None and m.proc.poll() is not None
                if exited or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {m.name} did not come up: "
                                       + m.log_path.read_text(errors="replace")[-2000:])
                time.sleep(0.02)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data directory stays) and reap it."""
        proc = self.members[i].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        self.members[i].proc = None

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its ports and the data it kept, and wait until it is
        healthy."""
        self.start(i)
        self.wait_healthy(i)

    def stop(self) -> None:
        """Stop every member: SIGTERM by PID, SIGKILL if it does not stop in time."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.send_signal(signal.SIGTERM)
                try:
                    m.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(STOP_TIMEOUT_S)
            m.proc = None


def start_cluster(base: Path, members: int = 1, flags: tuple[str, ...] = ()) -> EtcdCluster:
    """Start ``members`` etcd members on free loopback ports with data under ``base`` (and
    ``flags``) and wait until every one is healthy. The caller stops it with
    :meth:`EtcdCluster.stop`."""
    if etcd_binary() is None:
        raise RuntimeError(MISSING)
    ports = reserve(2 * members)
    tag = uuid.uuid4().hex[:6]
    ms = [EtcdMember(name=f"m{i}-{tag}", client_port=ports[2 * i],
                     peer_port=ports[2 * i + 1], data_dir=base / f"m{i}-{tag}.etcd",
                     log_path=base / f"m{i}-{tag}.log") for i in range(members)]
    cluster = EtcdCluster(members=ms,
                          initial_cluster=",".join(f"{m.name}={m.peer_url}" for m in ms),
                          flags=flags)
    try:
        for i in range(members):
            cluster.start(i, state="new")
        cluster.wait_healthy()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """The session's one-member etcd (see the module docstring): never kill it."""
    require(etcd_binary() is not None, MISSING)
    cluster = start_cluster(tmp_path_factory.mktemp("etcd"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[Callable[..., EtcdCluster]]:
    """A factory of private clusters, ``etcd_cluster(members)``, each stopped after the
    test: for the tests that kill and restart members."""
    require(etcd_binary() is not None, MISSING)
    started: list[EtcdCluster] = []

    def make(members: int = 1, flags: tuple[str, ...] = ()) -> EtcdCluster:
        cluster = start_cluster(tmp_path / f"etcd{len(started)}", members, flags)
        started.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for c in started:
            c.stop()
