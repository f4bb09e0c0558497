"""A loopback HTTP proxy that injects S3 faults by deterministic rules (tests only).

It sits between a client and a real S3 server (SeaweedFS): point the client's endpoint at
``proxy.endpoint``. Every client connection carries exactly one request (``Connection:
close`` is forced both ways), which keeps the proxy a few lines of plain sockets. The
proxy answers ``Expect: 100-continue`` itself, so signed requests pass through unchanged
(botocore does not sign ``Expect``; the ``Host`` header is forwarded as sent).

Rules match on method, a path substring and query substrings; the first rule that matches
and still has shots left fires. Actions:

====================  ===================================================================
``status``            answer ``status`` with an error ``code`` (500, 503 SlowDown) in the
                      store's dialect (``dialect``: S3's XML, GCS's JSON, or Azure's XML
                      with ``x-ms-error-code``), with ``Retry-After`` when the rule or the
                      proxy (``retry_after_s``) gives one
``reset``             read ``after_bytes`` of the request body, then reset the connection
``reset_after_store`` forward the whole request, drop the response, reset the connection
                      (the server stored it; the client saw an error)
``hang``              read the headers, then stall (never read the body, never answer)
``delay``             wait ``hang_s`` seconds, then forward (a slow server: it answers late)
``corrupt``           flip one byte of the request body (at ``offset``, default middle)
``reset_response``    forward, then send the response head and ``after_bytes`` of its body,
                      then reset
``corrupt_response``  forward, flip one byte of the response body
====================  ===================================================================

Handy matchers: :data:`UPLOAD_PART`, :data:`COMPLETE`, :data:`CREATE_UPLOAD`,
:data:`LIST_UPLOADS`, :data:`ABORT_UPLOAD`, :data:`PUT_OBJECT`, :data:`GET`.

A server that throttles: :meth:`FaultProxy.throttle` lets ``rate_per_s`` requests a second
through (a token bucket holding ``burst``) and answers every other with ``503 SlowDown`` (or
``429``) and a ``Retry-After`` header, as S3, GCS and Azure do above their request rates.

A server that lacks calls: :meth:`FaultProxy.not_implemented` answers ``501 NotImplemented``
to each of a set of matchers, forever — :data:`NO_MULTIPART_LISTING` (a small server, e.g.
s3rver or localbucket: multipart upload works, listing and aborting uploads do not) or
:data:`NO_MULTIPART` (no multipart upload at all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import threading
import time
from typing import Any

ACTIONS = ("status", "reset", "reset_after_store", "hang", "delay", "corrupt", "reset_response",
           "corrupt_response")
UPLOAD_PART: dict[str, Any] = {"method": "PUT", "query": "partNumber="}
COMPLETE: dict[str, Any] = {"method": "POST", "query": "uploadId="}
CREATE_UPLOAD: dict[str, Any] = {"method": "POST", "query": "uploads"}
LIST_UPLOADS: dict[str, Any] = {"method": "GET", "query": "uploads", "not_query": "list-type"}
ABORT_UPLOAD: dict[str, Any] = {"method": "DELETE", "query": "uploadId="}
PUT_OBJECT: dict[str, Any] = {"method": "PUT", "not_query": "partNumber="}
GET: dict[str, Any] = {"method": "GET", "not_query": "list-type"}
NO_MULTIPART_LISTING: tuple[dict[str, Any], ...] = (LIST_UPLOADS, ABORT_UPLOAD)
"""ListMultipartUploads and AbortMultipartUpload: what s3rver 3.7 and localbucket 1.2 answer
501 to (docs/tier2-servers.md)."""
NO_MULTIPART: tuple[dict[str, Any], ...] = (*NO_MULTIPART_LISTING, CREATE_UPLOAD,
                                            UPLOAD_PART, COMPLETE)
"""Every multipart call: a server with single PUTs only."""

_REASONS = {429: "Too Many Requests", 500: "Internal Server Error", 501: "Not Implemented",
            503: "Service Unavailable", 400: "Bad Request", 403: "Forbidden", 404: "Not Found"}


@dataclasses.dataclass
class Rule:
    """One fault. ``times=None`` fires forever; ``skip`` lets the first matches through."""

    action: str
    method: str | None = None
    path: str | None = None
    query: str | None = None
    not_query: str | None = None
    times: int | None = 1
    skip: int = 0
    status: int = 503
    code: str = "SlowDown"
    after_bytes: int = 0
    offset: int | None = None
    hang_s: float = 60.0
    retry_after_s: int | None = None
    matched: int = 0
    fired: int = 0

    def matches(self, method: str, path: str, query: str) -> bool:
        return ((self.method is None or self.method == method)
                and (self.path is None or self.path in path)
                and (self.query is None or self.query in query)
                and (self.not_query is None or self.not_query not in query))


@dataclasses.dataclass(frozen=True)
class Hit:
    """One request the proxy saw, and what it did with it (``pass`` or an action)."""

    method: str
    path: str
    query: str
    action: str


def _reset(sock: socket.socket) -> None:
    """Close with RST instead of FIN (SO_LINGER 0): the peer sees 'connection reset'."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("peer closed before the end of the headers")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _read_exact(sock: socket.socket, have: bytes, n: int) -> bytes:
    chunks, got = [have], len(have)
    while got < n:
        chunk = sock.recv(min(1 << 20, n - got))
        if not chunk:
            raise ConnectionError("peer closed mid-body")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _with_close(head_lines: list[bytes], drop: tuple[bytes, ...]) -> bytes:
    kept = [h for h in head_lines[1:] if h.split(b":", 1)[0].strip().lower() not in drop]
    return b"\r\n".join([head_lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n"


def _flip(body: bytes, offset: int | None) -> bytes:
    if not body:
        return body
    i = len(body) // 2 if offset is None else min(offset, len(body) - 1)
    return body[:i] + bytes([body[i] ^ 0xFF]) + body[i + 1:]


class FaultProxy:
    """The proxy. ``start()`` binds a free loopback port; use as a context manager."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1",
                 dialect: str = "s3", retry_after_s: int | None = None) -> None:
        if dialect not in _ERROR_BODIES:
            raise ValueError(f"dialect {dialect!r}: one of {sorted(_ERROR_BODIES)}")
        self.upstream = (upstream_host, upstream_port)
        self._host = host
        self.dialect = dialect
        self.retry_after_s = retry_after_s  # for a status rule that names none
        self._rules: list[Rule] = []
        self.hits: list[Hit] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._bucket: _TokenBucket | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self._host}:{self.port}"

    def start(self) -> FaultProxy:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self._host, 0))
        srv.listen(128)
        self._server, self.port = srv, srv.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="faultproxy",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_rule(self, action: str, **match: Any) -> Rule:
        """Add a rule (see the module docstring) and return it (its counters update)."""
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        rule = Rule(action=action, **match)
        with self._lock:
            self._rules.append(rule)
        return rule

    def not_implemented(self, calls: tuple[dict[str, Any], ...]) -> list[Rule]:
        """Answer ``501 NotImplemented`` to every request matching one of ``calls``, forever
        (e.g. :data:`NO_MULTIPART_LISTING`); returns the rules (their counters update)."""
        return [self.add_rule("status", status=501, code="NotImplemented", times=None, **m)
                for m in calls]

    def throttle(self, rate_per_s: float, *, burst: int = 1, status: int = 503,
                 code: str = "SlowDown", retry_after_s: int | None = 1,
                 warmup: tuple[float, float] | None = None) -> None:
        """Above ``rate_per_s`` requests a second (``burst`` at once), answer ``status``
        with ``code`` and ``Retry-After`` instead of forwarding (action ``throttle``);
        ``rate_per_s=0`` stops throttling. Applies before the rules. ``warmup=(rate, s)``
        serves only ``rate`` a second for the first ``s`` seconds, as S3 serves a new prefix
        before it scales out: the refusals then do not depend on how fast a loaded client
        machine can ask."""
        with self._lock:
            self._bucket = None if rate_per_s <= 0 else _TokenBucket(
                rate_per_s, burst, Rule(action="status", status=status, code=code,
                                        retry_after_s=retry_after_s, times=None), warmup)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.hits.clear()

    def actions(self) -> list[str]:
        """What the proxy did so far, one entry per request (``pass`` or an action)."""
        with self._lock:
            return [h.action for h in self.hits]

    # -- internals ----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _pick(self, method: str, path: str, query: str) -> Rule | None:
        with self._lock:
            if self._bucket is not None and not self._bucket.take():
                self.hits.append(Hit(method, path, query, "throttle"))
                return self._bucket.answer
            chosen = None
            for r in self._rules:
                if not r.matches(method, path, query):
                    continue
                r.matched += 1
                if r.matched > r.skip and (r.times is None or r.fired < r.times):
                    r.fired += 1
                    chosen = r
                    break
            self.hits.append(Hit(method, path, query, chosen.action if chosen else "pass"))
            return chosen

    def _handle(self, client: socket.socket) -> None:
        client.settimeout(60)
        try:
            self._serve_one(client)
        except OSError:
            pass  # the client gave up (timeout/reset): nothing to answer
        finally:
            with contextlib.suppress(OSError):
                client.close()

    def _serve_one(self, client: socket.socket) -> None:
        head, rest = _read_head(client)
        lines = head.split(b"\r\n")
        method, target, _ = lines[0].decode("latin-1").split(" ", 2)
        path, _, query = target.partition("?")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (h.decode("latin-1").partition(":") for h in lines[1:])}
        length = int(headers.get("content-length", "0"))
        rule = self._pick(method, path, query)
        action = rule.action if rule else "pass"
        if action == "hang":
            assert rule is not None
            self._stop.wait(rule.hang_s)
            return
        if action == "delay":
            assert rule is not None
            if self._stop.wait(rule.hang_s):
                return
        if headers.get("expect", "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if action == "reset":
            assert rule is not None
            _read_exact(client, rest[:rule.after_bytes], min(rule.after_bytes, length))
            _reset(client)
            return
        body = _read_exact(client, rest, length)
        if action == "status":
            assert rule is not None
            self._send_error(client, rule)
            return
        if action == "corrupt":
            assert rule is not None
            body = _flip(body, rule.offset)
        response = self._forward(_with_close(lines, (b"expect", b"connection")) + body)
        self._respond(client, response, rule)

    def _forward(self, request: bytes) -> bytes:
        with socket.create_connection(self.upstream, timeout=60) as up:
            up.sendall(request)
            chunks: list[bytes] = []
            while True:
                chunk = up.recv(1 << 20)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)

    def _respond(self, client: socket.socket, response: bytes, rule: Rule | None) -> None:
        rhead, _, rbody = response.partition(b"\r\n\r\n")
        out_head = _with_close(rhead.split(b"\r\n"), (b"connection",))
        action = rule.action if rule else "pass"
        if action == "reset_after_store":
            _reset(client)
        elif action == "reset_response":
            assert rule is not None
            client.sendall(out_head + rbody[:rule.after_bytes])
            _reset(client)
        else:
            if action == "corrupt_response":
                assert rule is not None
                rbody = _flip(rbody, rule.offset)
            client.sendall(out_head + rbody)

    def _send_error(self, client: socket.socket, rule: Rule) -> None:
        ctype, body = _ERROR_BODIES[self.dialect](rule)
        reason = _REASONS.get(rule.status, "Error")
        wait = rule.retry_after_s if rule.retry_after_s is not None else self.retry_after_s
        after = "" if wait is None else f"Retry-After: {wait}\r\n"
        azure = f"x-ms-error-code: {rule.code}\r\n" if self.dialect == "azure" else ""
        client.sendall(
            f"HTTP/1.1 {rule.status} {reason}\r\nContent-Type: {ctype}\r\n{after}{azure}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


def _xml_error(rule: Rule) -> tuple[str, bytes]:
    return "application/xml", (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
                               f"{rule.code}</Code><Message>injected by faultproxy</Message>"
                               "</Error>").encode()


def _json_error(rule: Rule) -> tuple[str, bytes]:
    return "application/json", (f'{{"error": {{"code": {rule.status}, "message": "injected '
                                f'by faultproxy", "errors": [{{"reason": "{rule.code}"}}]}}}}'
                                ).encode()


_ERROR_BODIES = {"s3": _xml_error, "azure": _xml_error, "gcs": _json_error}
"""How each store words an error: S3 and Azure in XML (Azure also names the code in its
``x-ms-error-code`` header), GCS in JSON with the code as the ``reason``."""


class _TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved; not thread-safe (the proxy's lock
    guards it)."""

    def __init__(self, rate: float, burst: int, answer: Rule,
                 warmup: tuple[float, float] | None = None) -> None:
        self.rate, self.burst, self.answer = rate, float(burst), answer
        self.tokens, self.at = float(burst), time.monotonic()
        self.warm_rate, warm_s = warmup or (rate, 0.0)
        self.warm_until = self.at + warm_s

    def take(self) -> bool:
        now = time.monotonic()
        rate = self.warm_rate if now < self.warm_until else self.rate
        self.tokens = min(self.burst, self.tokens + (now - self.at) * rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True
