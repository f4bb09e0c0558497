"""What a run's uploads to tier 2 did, from its events: how many steps reached tier 2, how
many attempts failed, the bytes sent against the bytes those steps refer to (content
addressing sends only what tier 2 does not hold yet), and what the store's throttling cost.
Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

VERIFIED = "upload_verified"
FAILED = "upload_failed"


@dataclasses.dataclass(frozen=True)
class Tier2Uploads:
    """Totals over a run's ``upload_verified`` and ``upload_failed`` events (every attempt
    of every uploader that wrote to the run's event log)."""

    verified: int = 0
    failed: int = 0
    bytes: int = 0
    """Bytes the verified uploads sent."""
    referenced: int = 0
    """Bytes the verified steps refer to: ``bytes`` plus what tier 2 already held (an
    uploader before this field counted only what it sent: its steps add ``bytes``)."""
    throttled_requests: int = 0
    """Requests the store refused for their rate (``503 SlowDown``, ``429``), all retried."""
    throttled_s: float = 0.0
    """Seconds spent waiting before sending those requests again."""

    @property
    def any(self) -> bool:
        return bool(self.verified or self.failed)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(records: Iterable[Mapping[str, Any]]) -> Tier2Uploads:
    """The upload totals of ``records`` (a run's events, in any order)."""
    verified = failed = sent = referenced = requests = 0
    seconds = 0.0
    for r in records:
        if r.get("event") not in (VERIFIED, FAILED):
            continue
        verified += r["event"] == VERIFIED
        failed += r["event"] == FAILED
        if r["event"] == VERIFIED:
            sent += int(r.get("bytes") or 0)
            referenced += int(r.get("referenced") or r.get("bytes") or 0)
        requests += int(r.get("throttled_requests") or 0)
        seconds += float(r.get("throttled_s") or 0.0)
    return Tier2Uploads(verified=verified, failed=failed, bytes=sent, referenced=referenced,
                        throttled_requests=requests, throttled_s=seconds)
