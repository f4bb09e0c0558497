"""How a multi-node job names its nodes and its store, checked once for ``tierckpt run``
(:mod:`tierckpt.heal.nodes`), the launch kit (:mod:`tierckpt.launch`) and ``doctor``:
``--nnodes MIN[:MAX]``, ``etcd://host:port[,host:port]`` and the signals a supervisor
passes on; and :func:`member_health`, one ``GET /health`` to an etcd member (for ``doctor``
and a drill's own etcd). Torch-free."""

from __future__ import annotations

import json
import urllib.request

from tierckpt.errors import ConfigError

__all__ = ["FORWARDED", "member_health", "member_space", "parse_endpoint", "parse_nnodes"]

FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1")
"""The signals ``tierckpt run`` passes on to its workers (then waits for them to end)."""


def parse_nnodes(text: str) -> tuple[int, int]:
    """``MIN`` or ``MIN:MAX`` as (MIN, MAX); ConfigError for anything else."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {text!r}: give MIN or MIN:MAX with 1 <= MIN <= MAX "
                          "(nodes beyond MIN wait as spare nodes)")
    return lo, hi


def parse_endpoint(text: str, *, flag: str = "--rdzv-endpoint") -> str:
    """``etcd://host:port[,host:port]`` (or the bare ``host:port`` list) as etcd client URLs
    ``http://host:port,...``; ConfigError naming ``flag`` for anything else."""
    body = text.removeprefix("etcd://")
    hosts = [h.strip() for h in body.split(",") if h.strip()]
    if not hosts or "://" in body or any(":" not in h for h in hosts):
        raise ConfigError(f"{flag} {text!r}: give the job's etcd as "
                          "etcd://host:port[,host:port...] (every member's client URL)")
    return ",".join(f"http://{h}" for h in hosts)


def member_health(url: str, timeout: float) -> str | None:
    """None when the etcd member at ``url`` (``http://host:port``) answers ``GET /health``
    as healthy within ``timeout`` seconds; else what it answered, or why it did not."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            said = json.loads(r.read())
    except (OSError, ValueError) as e:
        return f"no answer ({getattr(e, 'reason', e)})"
    return None if str(said.get("health")) == "true" else f"unhealthy ({said})"


def member_space(url: str, timeout: float) -> tuple[int | None, list[str]]:
    """The etcd member at ``url``'s database size in bytes (None: not answered) and the
    cluster's raised alarms (``NOSPACE``: the database reached its quota and etcd refuses
    every write; ``CORRUPT``)."""
    def ask(path: str, body: bytes) -> dict[str, object]:
        req = urllib.request.Request(f"{url}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return dict(json.loads(r.read()))
    try:
        size = ask("/v3/maintenance/status", b"{}").get("dbSize")
        alarms = ask("/v3/maintenance/alarm", b'{"action": "GET"}').get("alarms")
    except (OSError, ValueError):
        return None, []
    raised = sorted({str(a.get("alarm")) for a in alarms if isinstance(a, dict)} - {"NONE"}
                    if isinstance(alarms, list) else set())
    return (int(str(size)) if size is not None else None), raised
