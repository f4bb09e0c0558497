"""The notice pollers against a real HTTP server on 127.0.0.1 and real files.

The server serves canned answers from a route table the test switches while it runs, and
records every request (method, path, headers) so a test can check what was sent."""

from __future__ import annotations

import datetime
import http.server
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tierckpt.errors import ConfigError, NoticeSourceError
from tierckpt.preempt.config import Poller, Preemption
from tierckpt.preempt.pollers import (
    AWS_ACTION_PATH,
    AWS_TOKEN_PATH,
    GCP_MAINTENANCE_PATH,
    GCP_PREEMPTED_PATH,
    AwsSpot,
    FileTrigger,
    GcpPreemption,
)

Answer = tuple[int, dict[str, str], str]
Route = Callable[[dict[str, str]], Answer]


@dataclass
class Metadata:
    """A switchable metadata server: ``routes[(method, path)]`` answers a request."""

    url: str
    routes: dict[tuple[str, str], Route] = field(default_factory=dict)
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def answer(self, method: str, path: str, status: int, body: str = "",
               headers: dict[str, str] | None = None) -> None:
        self.routes[(method, path)] = lambda _h: (status, dict(headers or {}), body)

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _ in self.seen if method is None or m == method]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def _serve(self) -> None:
        md = self.server.md
        headers = {k.lower(): v for k, v in self.headers.items()}
        md.seen.append((self.command, self.path, headers))
        route = md.routes.get((self.command, self.path))
        status, extra, body = route(headers) if route else (404, {}, "not found")
        data = body.encode()
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = _serve

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    md: Metadata


@pytest.fixture
def metadata() -> Iterator[Metadata]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.md = Metadata(url=f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, args=(0.05,),
                              daemon=True)
    thread.start()
    try:
        yield server.md
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def silent() -> Iterator[str]:
    """An endpoint whose socket accepts connections (the kernel completes the handshake into
    the backlog) and never sends a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _closed_port() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


# --- AWS -------------------------------------------------------------------------------

TOKEN = "AQAEAJnr-test-token=="


def _imdsv2(md: Metadata) -> None:
    """IMDSv2 as EC2 serves it: a token for a PUT with a TTL; GETs without it get 401."""
    def token(h: dict[str, str]) -> Answer:
        if "x-aws-ec2-metadata-token-ttl-seconds" not in h:
            return 400, {}, "missing ttl"
        return 200, {}, TOKEN
    md.routes[("PUT", AWS_TOKEN_PATH)] = token
    md.answer("GET", AWS_ACTION_PATH, 404)

    def guard(inner: Route) -> Route:
        return lambda h: inner(h) if h.get("x-aws-ec2-metadata-token") == TOKEN \
            else (401, {}, "")
    md.routes[("GET", AWS_ACTION_PATH)] = guard(md.routes[("GET", AWS_ACTION_PATH)])


def _set_action(md: Metadata, status: int, body: str) -> None:
    md.routes[("GET", AWS_ACTION_PATH)] = lambda h: (
        (status, {"Content-Type": "application/json"}, body)
        if h.get("x-aws-ec2-metadata-token") == TOKEN else (401, {}, ""))


def test_aws_no_action_is_none_and_the_token_is_sent(metadata: Metadata) -> None:
    _imdsv2(metadata)
    p = AwsSpot(endpoint=metadata.url)
    assert isinstance(p, Poller)
    assert p.poll() is None
    assert p.poll() is None
    assert metadata.paths("PUT") == [AWS_TOKEN_PATH]  # the token is kept between polls
    gets = [h for m, _, h in metadata.seen if m == "GET"]
    assert len(gets) == 2 and all(h["x-aws-ec2-metadata-token"] == TOKEN for h in gets)
    assert not p.imds_v1


def test_aws_instance_action_is_a_notice_with_its_deadline(metadata: Metadata) -> None:
    _imdsv2(metadata)
    p = AwsSpot(endpoint=metadata.url + "/")
    assert p.poll() is None
    _set_action(metadata, 200, '{"action": "terminate", "time": "2026-12-02T12:00:00Z"}')
    n = p.poll()
    assert n is not None
    assert (n.source, n.detail) == ("aws", "terminate")
    want = datetime.datetime(2026, 12, 2, 12, 0, tzinfo=datetime.timezone.utc).timestamp()
    assert n.deadline_unix == want
    asked = len(metadata.seen)
    _set_action(metadata, 404, "")
    assert p.poll() is n  # latched: the same notice, and nothing asked again
    assert len(metadata.seen) == asked


def test_aws_token_is_required_and_renewed_on_401(metadata: Metadata) -> None:
    _imdsv2(metadata)
    p = AwsSpot(endpoint=metadata.url)
    assert p.poll() is None
    p._token = "expired"  # what a token past its TTL looks like to the server
    assert p.poll() is None
    assert metadata.paths("PUT") == [AWS_TOKEN_PATH, AWS_TOKEN_PATH]
    statuses = [h.get("x-aws-ec2-metadata-token") for m, _, h in metadata.seen if m == "GET"]
    assert statuses == [TOKEN, "expired", TOKEN]


@pytest.mark.parametrize("refusal", [403, 404, 405])
def test_aws_falls_back_to_imdsv1_without_a_token(metadata: Metadata, refusal: int) -> None:
    metadata.answer("PUT", AWS_TOKEN_PATH, refusal)
    metadata.answer("GET", AWS_ACTION_PATH, 404)
    p = AwsSpot(endpoint=metadata.url)
    assert p.poll() is None
    assert p.imds_v1
    metadata.answer("GET", AWS_ACTION_PATH, 200, '{"action": "stop", "time": '
                    '"2026-12-02T12:02:00Z"}')
    n = p.poll()
    assert n is not None and n.detail == "stop"
    assert metadata.paths("PUT") == [AWS_TOKEN_PATH]  # asked once, then v1 only
    assert all("x-aws-ec2-metadata-token" not in h for m, _, h in metadata.seen if m == "GET")


@pytest.mark.parametrize("body", ["<html>captive portal</html>", '["terminate"]',
                                  '{"time": "2026-12-02T12:00:00Z"}',
                                  '{"action": "terminate", "time": "next tuesday"}'])
def test_aws_malformed_body_is_a_clear_error(metadata: Metadata, body: str) -> None:
    _imdsv2(metadata)
    _set_action(metadata, 200, body)
    p = AwsSpot(endpoint=metadata.url)
    with pytest.raises(NoticeSourceError, match=r"aws: GET http://127\.0\.0\.1:\d+/latest"):
        p.poll()
    assert p.notice is None


def test_aws_action_without_time_uses_the_grace(metadata: Metadata) -> None:
    _imdsv2(metadata)
    _set_action(metadata, 200, '{"action": "terminate"}')
    n = AwsSpot(endpoint=metadata.url, grace_s=90.0).poll()
    assert n is not None and n.deadline_unix == n.received_unix + 90.0


def test_aws_server_error_names_the_status(metadata: Metadata) -> None:
    _imdsv2(metadata)
    _set_action(metadata, 500, "boom")
    with pytest.raises(NoticeSourceError, match="answered 500"):
        AwsSpot(endpoint=metadata.url).poll()


def test_aws_endpoint_that_never_answers_raises_after_the_timeout(silent: str) -> None:
    p = AwsSpot(endpoint=silent, timeout_s=0.3)
    with pytest.raises(NoticeSourceError, match="did not answer within"):
        p.poll()
    with pytest.raises(NoticeSourceError, match="did not answer within"):
        p.poll()  # and again: an error is never latched


def test_aws_refused_connection_is_a_clear_error() -> None:
    with pytest.raises(NoticeSourceError, match="check the endpoint"):
        AwsSpot(endpoint=_closed_port(), timeout_s=0.5).poll()


def test_http_pollers_ignore_the_environment_proxy(metadata: Metadata,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", _closed_port())
    monkeypatch.setenv("HTTP_PROXY", _closed_port())
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    _imdsv2(metadata)
    assert AwsSpot(endpoint=metadata.url).poll() is None


@pytest.mark.parametrize("bad", ["169.254.169.254", "ftp://x", "http://h/latest",
                                 "http://h:99999", "http://"])
def test_endpoint_must_be_a_bare_http_url(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"AwsSpot\.endpoint"):
        AwsSpot(endpoint=bad)
    with pytest.raises(ConfigError, match=r"GcpPreemption\.endpoint"):
        GcpPreemption(endpoint=bad)


def test_timeouts_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"AwsSpot\.timeout_s"):
        AwsSpot(timeout_s=0)
    with pytest.raises(ConfigError, match=r"GcpPreemption\.every_s"):
        GcpPreemption(every_s=float("nan"))
    with pytest.raises(ConfigError, match="token_ttl_s"):
        AwsSpot(token_ttl_s=50000)


# --- GCP -------------------------------------------------------------------------------

GOOGLE = {"Metadata-Flavor": "Google"}


def _gcp(md: Metadata, preempted: str = "FALSE", event: str | None = "NONE") -> None:
    def needs_flavor(status: int, body: str) -> Route:
        return lambda h: (status, GOOGLE, body) if h.get("metadata-flavor") == "Google" \
            else (403, GOOGLE, "Missing Metadata-Flavor:Google header.")
    md.routes[("GET", GCP_PREEMPTED_PATH)] = needs_flavor(200, preempted)
    if event is None:
        md.routes.pop(("GET", GCP_MAINTENANCE_PATH), None)
    else:
        md.routes[("GET", GCP_MAINTENANCE_PATH)] = needs_flavor(200, event)


def test_gcp_not_preempted_is_none(metadata: Metadata) -> None:
    _gcp(metadata)
    p = GcpPreemption(endpoint=metadata.url)
    assert isinstance(p, Poller)
    assert p.poll() is None
    assert metadata.paths() == [GCP_PREEMPTED_PATH, GCP_MAINTENANCE_PATH]
    assert all(h["metadata-flavor"] == "Google" for _, _, h in metadata.seen)


def test_gcp_preempted_is_a_notice_with_the_grace(metadata: Metadata) -> None:
    _gcp(metadata)
    p = GcpPreemption(endpoint=metadata.url, grace_s=25.0)
    assert p.poll() is None
    _gcp(metadata, preempted="TRUE")
    n = p.poll()
    assert n is not None
    assert (n.source, n.detail) == ("gcp", "preempted")
    assert n.deadline_unix == n.received_unix + 25.0
    assert p.poll() is n


@pytest.mark.parametrize("event", ["TERMINATE_ON_HOST_MAINTENANCE",
                                   "MIGRATE_ON_HOST_MAINTENANCE"])
def test_gcp_maintenance_event_is_a_notice(metadata: Metadata, event: str) -> None:
    _gcp(metadata, event=event)
    n = GcpPreemption(endpoint=metadata.url).poll()
    assert n is not None and (n.source, n.detail) == ("gcp", event)


def test_gcp_maintenance_key_not_served_is_none(metadata: Metadata) -> None:
    _gcp(metadata, event=None)
    assert GcpPreemption(endpoint=metadata.url).poll() is None


@pytest.mark.parametrize(("preempted", "event", "match"), [
    ("maybe", "NONE", "expected TRUE or FALSE"),
    ("FALSE", "<html>", "expected NONE or an event name"),
])
def test_gcp_malformed_answer_is_a_clear_error(metadata: Metadata, preempted: str,
                                               event: str, match: str) -> None:
    _gcp(metadata, preempted=preempted, event=event)
    with pytest.raises(NoticeSourceError, match=match):
        GcpPreemption(endpoint=metadata.url).poll()


def test_gcp_answer_without_the_flavor_header_is_refused(metadata: Metadata) -> None:
    metadata.answer("GET", GCP_PREEMPTED_PATH, 200, "FALSE")  # no Metadata-Flavor back
    with pytest.raises(NoticeSourceError, match="not a GCE metadata server"):
        GcpPreemption(endpoint=metadata.url).poll()


def test_gcp_endpoint_that_never_answers_raises_after_the_timeout(silent: str) -> None:
    with pytest.raises(NoticeSourceError, match="did not answer within"):
        GcpPreemption(endpoint=silent, timeout_s=0.3).poll()


def test_pollers_fit_the_preemption_config(metadata: Metadata, tmp_path: Path) -> None:
    cfg = Preemption(pollers=(AwsSpot(endpoint=metadata.url),
                              GcpPreemption(endpoint=metadata.url),
                              FileTrigger(tmp_path / "stop", grace_s=30.0)))
    assert [p.name for p in cfg.pollers] == ["aws", "gcp", f"file:{tmp_path / 'stop'}"]


# --- FileTrigger -----------------------------------------------------------------------

def test_file_trigger_none_until_the_file_appears(tmp_path: Path) -> None:
    path = tmp_path / "stop"
    p = FileTrigger(path, grace_s=30.0)
    assert isinstance(p, Poller)
    assert p.poll() is None
    assert p.poll() is None
    path.write_text("")
    n = p.poll()
    assert n is not None
    assert n.source == f"file:{path}"
    assert n.deadline_unix == n.received_unix + 30.0
    assert "empty" in n.detail
    path.unlink()
    assert p.poll() is n  # a notice is never withdrawn


def test_file_trigger_number_is_grace_from_mtime(tmp_path: Path) -> None:
    path = tmp_path / "stop"
    path.write_text("25\n")
    mtime = 1_900_000_000.0
    os.utime(path, (mtime, mtime))
    n = FileTrigger(path, grace_s=30.0).poll()
    assert n is not None
    assert n.deadline_unix == mtime + 25.0
    assert "25 s of grace" in n.detail


@pytest.mark.parametrize("content", ["soon", "-5", "nan", "inf"])
def test_file_trigger_other_content_uses_the_configured_grace(tmp_path: Path,
                                                              content: str) -> None:
    path = tmp_path / "stop"
    path.write_text(content)
    n = FileTrigger(path, grace_s=12.0).poll()
    assert n is not None
    assert n.deadline_unix == n.received_unix + 12.0
    assert "not a number of seconds" in n.detail


def test_file_trigger_ignores_a_file_left_from_an_earlier_run(tmp_path: Path) -> None:
    path = tmp_path / "stop"
    path.write_text("")
    os.utime(path, (1_000.0, 1_000.0))
    p = FileTrigger(path, grace_s=30.0, since_unix=2_000.0)
    assert p.poll() is None
    os.utime(path, (3_000.0, 3_000.0))  # written again, after the job started
    assert p.poll() is not None


def test_file_trigger_unreadable_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "stop"
    path.mkdir()  # exists, cannot be read as a file
    with pytest.raises(NoticeSourceError, match="cannot be read"):
        FileTrigger(path, grace_s=30.0).poll()


def test_file_trigger_validates_its_seconds(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"FileTrigger\.grace_s"):
        FileTrigger(tmp_path / "stop", grace_s=-1)
