"""pytest plugin: Azurite, Azure's official Blob Storage emulator (npm ``azurite``), on
loopback for the session.

Fixtures (registered from tests/conftest.py):

- ``azurite_server`` (session): the running emulator, an :class:`AzuriteServer`. Started
  once (``azurite-blob`` on 127.0.0.1, a reserved free port, in-memory, telemetry off),
  its container created; stopped by PID at the end of the session.
- ``azure_env`` (function): an :class:`AzureEnv` for one test: a fresh prefix in the
  session container (``url`` is ``az://container/<unique prefix>``), and
  ``AZURE_STORAGE_CONNECTION_STRING`` set in ``os.environ`` for the test's duration (the
  other ``AZURE_STORAGE_*`` variables removed), so ``open_storage(url)`` and child
  processes find the emulator through the standard chain.
- ``azure_fault_proxy`` (function): a :class:`faultproxy.FaultProxy` in front of the
  emulator, with the connection string pointing at it for this test.

Azurite is installed by the Makefile (``npm install --prefix .venv/node azurite@3.37.0``);
a missing one fails under ``CI=true`` and skips elsewhere (:func:`tests._require.require`).
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._require import require
from tierckpt._ports import reserve

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")  # Azurite's well-known development key (public, test-only)
CONTAINER = "tierckpt-test"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
AZURE_VARS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
              "AZURE_STORAGE_KEY")


def azurite_binary() -> str | None:
    """``azurite-blob`` from the venv's npm prefix (``.venv/node``), else on PATH."""
    here = Path(sys.executable).parent.parent / "node" / "node_modules" / ".bin" / "azurite-blob"
    return str(here) if here.exists() else shutil.which("azurite-blob")


def connection_string(endpoint: str) -> str:
    """The dev account's connection string with the blob service at ``endpoint``."""
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")


@dataclasses.dataclass
class AzuriteServer:
    """A running Azurite blob service: its endpoint (``http://127.0.0.1:port``), PID, log
    and pre-created container."""

    endpoint: str
    pid: int
    log_path: Path
    container: str = CONTAINER

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The variables a client needs (``endpoint`` overrides, e.g. a proxy)."""
        return {"AZURE_STORAGE_CONNECTION_STRING": connection_string(endpoint or self.endpoint)}

    def container_client(self) -> Any:
        """An SDK client of the container that talks to Azurite directly."""
        from azure.storage.blob import ContainerClient

        return ContainerClient.from_connection_string(connection_string(self.endpoint),
                                                      self.container)


@dataclasses.dataclass
class AzureEnv:
    """One test's slice of the emulator: ``url`` = ``az://container/prefix`` (fresh)."""

    server: AzuriteServer
    prefix: str
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"az://{self.server.container}/{self.prefix}"

    def keys(self, *, uncommitted: bool = False) -> list[str]:
        """Every blob name under this test's prefix, relative to it (``uncommitted``: also
        blobs with only uncommitted blocks)."""
        c = self.server.container_client()
        blobs = c.list_blobs(name_starts_with=self.prefix + "/",
                             include=["uncommittedblobs"] if uncommitted else None)
        return sorted(b.name[len(self.prefix) + 1:] for b in blobs)


def start_azurite(base: Path) -> tuple[subprocess.Popen[bytes], AzuriteServer]:
    """Start ``azurite-blob`` on a reserved loopback port, wait until it answers, create the
    container. The caller stops it with :func:`stop_azurite`."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import ContainerClient

    binary = azurite_binary()
    assert binary is not None
    port = reserve(1)[0]
    log_path = base / "azurite.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port),
             "--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry",
             "--silent"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=base,
            start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    client = ContainerClient.from_connection_string(
        connection_string(endpoint), CONTAINER, retry_total=0, connection_timeout=1)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            client.create_container()
            break
        except ResourceExistsError:
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_azurite(proc)
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"Azurite did not come up:\n{tail}") from None
            time.sleep(0.1)
    return proc, AzuriteServer(endpoint=endpoint, pid=proc.pid, log_path=log_path)


def stop_azurite(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the emulator by PID, SIGKILL if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    """The session's Azurite (see the module docstring)."""
    try:
        import azure.storage.blob  # noqa: F401
    except ImportError:
        require(False, "azure-storage-blob is missing (pip install 'tierckpt[azure]')")
    require(azurite_binary() is not None,
            "Azurite is missing (make venv installs it: npm install --prefix .venv/node "
            "azurite@3.37.0; node and npm come from apt-get install nodejs npm)")
    proc, server = start_azurite(tmp_path_factory.mktemp("azurite"))
    try:
        yield server
    finally:
        stop_azurite(proc)


def _env_for(server: AzuriteServer, monkeypatch: pytest.MonkeyPatch,
             endpoint: str | None = None) -> AzureEnv:
    for k in AZURE_VARS:
        monkeypatch.delenv(k, raising=False)
    env = server.env(endpoint)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return AzureEnv(server=server, prefix=f"t-{uuid.uuid4().hex[:12]}", env=env)


@pytest.fixture
def azure_env(azurite_server: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> AzureEnv:
    """A fresh ``az://container/prefix`` for this test, the connection string in os.environ."""
    return _env_for(azurite_server, monkeypatch)


@pytest.fixture
def azure_fault_proxy(azure_env: AzureEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A :class:`faultproxy.FaultProxy` in front of Azurite (its errors worded as Azure's),
    the connection string (and ``azure_env.env``) pointing at it for this test, so storage
    opened afterwards goes through the proxy; ``azure_env.keys()`` still asks Azurite
    directly."""
    from faultproxy import FaultProxy

    host, port = azure_env.server.endpoint.removeprefix("http://").rsplit(":", 1)
    with FaultProxy(host, int(port), dialect="azure") as proxy:
        azure_env.env.update(azure_env.server.env(proxy.endpoint))
        for k, v in azure_env.env.items():
            monkeypatch.setenv(k, v)
        yield proxy

