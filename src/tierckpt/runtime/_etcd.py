"""etcd v3 spoken through its JSON gateway (``POST /v3/kv/range``, ``/v3/kv/put``,
``/v3/kv/txn``, ``/v3/kv/deleterange``, ``/v3/watch``) with the standard library, across the
client URLs of every member: the transport under :class:`tierckpt.runtime.etcdstore.EtcdStore`.
Torch-free, so that a supervisor or ``doctor`` can reach the job's etcd before (or without)
importing torch.

Why not a client library: python-etcd speaks only v2 (what torch's own etcd store uses) and
etcd 3.4 serves v2 only behind ``--enable-v2``; etcd3 needs grpcio and generated protobufs at
pinned versions; etcd3gw is this same gateway wrapped in requests, with no failover between
endpoints and no deadline on a watch. What the store needs is five POSTs and one stream.

Contract: :meth:`EtcdClient.call` retries one request until its deadline, moving to the next
endpoint on a connection error or an answer that says "try again" (HTTP 5xx or 429: no
leader, leader changed, a member shutting down), so a restarted etcd or a lost member of a
3-member cluster is invisible to the caller within the deadline. A request may therefore
reach etcd more than once: callers send only requests that are safe to repeat (a put of the
same value, a read, or a transaction that recognises its own earlier success). Past the
deadline it raises ``ConnectionError`` naming every URL and what to check; an answer that
retrying cannot fix (HTTP 4xx: too large, too many operations, permission) raises
``RuntimeError`` with etcd's message.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

REQUEST_TIMEOUT_S = 1.0
"""How long one HTTP request waits on one endpoint, in the first round, before the next one
is tried; each later round doubles it, up to 10 s (past etcd's own request timeout), so that
an etcd that is slow rather than gone still answers. Why 1 s, measured: a follower that
forwarded a write to a leader just killed answers nothing until etcd's request timeout (5 s
and more), while a member that already saw the election answers in milliseconds."""

BACKOFF_S = (0.02, 0.05, 0.1, 0.2, 0.5)
"""Pauses after a round in which no endpoint answered, then 0.5 s each."""

WATCH_CAP_S = 5.0
"""The longest one watch waits before its caller reads again (a safety net: a watch that was
cancelled or lost an event costs at most this)."""

MAX_TXN_OPS = 64
"""Operations per transaction when reading many keys at once (etcd's limit is 128)."""


def b64(data: bytes) -> str:
    """Bytes as the gateway's JSON carries them."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    """The gateway's base64 field as bytes (absent means empty)."""
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``http://host:port`` URLs from a comma-separated string or a list; ``host:port`` gets
    ``http://``. Raises ValueError for an empty list or a URL that is not http(s)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for raw in (e.strip().rstrip("/") for e in items):
        if not raw:
            continue
        url = raw if "://" in raw else f"http://{raw}"
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path:
            raise ValueError(f"etcd endpoint {raw!r}: give a client URL such as "
                             "http://10.0.0.1:2379")
        out.append(url)
    if not out:
        raise ValueError("no etcd endpoint given: pass the client URLs of the job's etcd "
                         "members, comma-separated (http://10.0.0.1:2379,...)")
    return out


class EtcdClient:
    """The endpoints of one etcd cluster. Thread-safe: each thread keeps its own keep-alive
    connection per endpoint (a forked child opens its own). A context manager; ``close()``
    closes every connection and is idempotent."""

    def __init__(self, endpoints: str | Sequence[str]) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self._current = 0  # the endpoint that answered last: tried first
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[http.client.HTTPConnection] = []
        self._epoch = 0  # bumped by close(): every thread's pool of the epoch before is stale

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection of every thread; later calls open new ones."""
        with self._lock:
            conns, self._open = self._open, []
            self._epoch += 1
        for c in conns:
            c.close()

    @property
    def url(self) -> str:
        """The endpoint tried first (the one that answered last)."""
        return self.endpoints[self._current]

    def call(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """POST ``body`` to ``path`` (``/v3/kv/txn``, ...) and return etcd's JSON answer,
        retrying across endpoints until ``deadline`` (``time.monotonic()``); see the module
        docstring for what is retried and what is raised."""
        data = json.dumps(body).encode()
        errors: dict[str, str] = {}
        rounds = 0
        while True:
            start = self._current
            for k in range(len(self.endpoints)):
                i = (start + k) % len(self.endpoints)
                answer = self._post(i, path, data, deadline,
                                    min(REQUEST_TIMEOUT_S * 2 ** rounds, 10.0))
                if isinstance(answer, dict):
                    self._current = i
                    return answer
                errors[self.endpoints[i]] = answer
                if time.monotonic() >= deadline:
                    break
            if time.monotonic() >= deadline:
                raise ConnectionError(self._unreachable(errors))
            pause = BACKOFF_S[min(rounds, len(BACKOFF_S) - 1)]
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            rounds += 1

    def watch(self, key: bytes, start_revision: int, deadline: float) -> None:
        """Return once ``key`` changed at or after ``start_revision``, at ``deadline``, after
        WATCH_CAP_S, or soon after an error: the caller reads again in every case (a watch
        is only a wake-up, never the source of a value)."""
        budget = min(deadline - time.monotonic(), WATCH_CAP_S)
        if budget <= 0:
            return
        body = json.dumps({"create_request": {"key": b64(key),
                                              "start_revision": str(start_revision)}})
        conn = None
        try:
            conn = _connection(self.url, budget)
            conn.request("POST", "/v3/watch", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise OSError(f"watch answered HTTP {resp.status}")
            while True:
                line = resp.readline()
                if not line:
                    raise OSError("watch stream ended")
                result = json.loads(line).get("result", {})
                if result.get("events") or result.get("canceled"):
                    return
        except TimeoutError:
            return  # the normal end of a quiet watch
        except (OSError, http.client.HTTPException, ValueError):
            time.sleep(0.01)  # etcd gone or restarting: the caller's read fails over; no spin
        finally:
            if conn is not None:
                conn.close()

    def _post(self, i: int, path: str, data: bytes, deadline: float, wait_s: float
              ) -> dict[str, Any] | str:
        """One request to endpoint ``i``: etcd's answer, or why to try the next endpoint. A
        kept-alive connection that fails is retried once on a fresh one (etcd may have closed
        it idle, or restarted since)."""
        url = self.endpoints[i]
        for fresh in (False, True):
            timeout = max(0.05, min(wait_s, deadline - time.monotonic()))
            reused = False
            try:
                conn, reused = self._conn(url, fresh, timeout)
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                conn.request("POST", path, body=data,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop(url)
                if reused and not fresh:
                    continue
                return f"{type(e).__name__}: {e}"
            return _answer(url, path, resp.status, raw)
        raise AssertionError("unreachable")

    def _conn(self, url: str, fresh: bool, timeout: float
              ) -> tuple[http.client.HTTPConnection, bool]:
        pool = getattr(self._local, "pool", None)
        if pool is None or getattr(self._local, "owner", None) != (os.getpid(), self._epoch):
            pool = self._local.pool = {}  # a forked child never shares its parent's sockets
            self._local.owner = (os.getpid(), self._epoch)
        conn = None if fresh else pool.get(url)
        if conn is not None:
            return conn, True
        conn = pool[url] = _connection(url, timeout)
        with self._lock:
            self._open.append(conn)
        return conn, False

    def _drop(self, url: str) -> None:
        conn = getattr(self._local, "pool", {}).pop(url, None)
        if conn is not None:
            conn.close()
            with self._lock, contextlib.suppress(ValueError):
                self._open.remove(conn)

    def _unreachable(self, errors: dict[str, str]) -> str:
        tried = "; ".join(f"{u} ({errors.get(u, 'not tried')})" for u in self.endpoints)
        return (f"no etcd endpoint answered before the deadline: {tried}. Check that etcd "
                "runs and listens on these client URLs (`curl <url>/health` answers "
                '{"health":"true"} on a member with a leader), that a majority of the '
                "cluster's members are up, and that this node can reach them")


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=timeout)
    conn.connect()  # here, so that TCP_NODELAY holds from the first request
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _answer(url: str, path: str, status: int, raw: bytes) -> dict[str, Any] | str:
    """etcd's JSON answer; why to try again (5xx, 429: a string); or RuntimeError (4xx)."""
    try:
        answer: dict[str, Any] = json.loads(raw) if raw else {}
    except ValueError:
        answer = {"error": raw[:200].decode(errors="replace")}
    if status == 200 and "error" not in answer:
        return answer
    message = answer.get("message") or answer.get("error") or f"HTTP {status}"
    if status >= 500 or status == 429:
        return f"HTTP {status}: {message}"
    raise RuntimeError(f"etcd at {url} refused {path}: HTTP {status}: {message}")
