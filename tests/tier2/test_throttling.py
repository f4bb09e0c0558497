"""Tier 2 under throttling: 256 clients against one endpoint that answers ``503 SlowDown``
with ``Retry-After`` above its request rate (the faultproxy's token bucket in front of
SeaweedFS), as S3 does to a few hundred ranks of one job.

What must hold: no save is lost — each of 256 uploaders (one per node of a large job, each
its own client, its own tier-1 root and its own prefix) ends with its step complete and
verified on tier 2, through the uploader's own loop and backoff; and a throttled LIST is
never read as an empty tier 2 — 256 readers each get every complete step, or an error,
never fewer steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy
from s3server import S3Env

from tests._synthetic import make_checkpoint
from tierckpt.errors import StorageError
from tierckpt.format import layout
from tierckpt.policy import uploads
from tierckpt.runtime.events import read_events
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage
from tierckpt.tier2.uploader import DONE, Uploader, UploaderConfig, watch
from tierckpt.tier2.uploader.config import UploadResult

CLIENTS = 256
SMALL = {".metadata": (300, None), "__0_0.distcp": (3000, 0)}
# The probe is the job's (cached on tier 1): each uploader here is told the modes instead.
OPTIONS = {"integrity": "crc32c", "marker": "create-only", "max_attempts": 3,
           "read_timeout_s": 20.0, "connect_timeout_s": 5.0}
RATE = 200.0
"""Requests a second the endpoint serves; the rest get 503 SlowDown (Retry-After: 1)."""
WARMUP = (20.0, 10.0)
"""The first 10 s the endpoint serves 20 requests a second (a new prefix before S3 scales
it out): 256 clients then get refused more than once each however loaded this machine is."""


def run_threads(n: int, body: Callable[[int], Any], timeout_s: float) -> list[Any]:
    """``body(i)`` on ``n`` threads at once; each result, or the exception it raised."""
    out: list[Any] = [None] * n
    go = threading.Barrier(n)

    def one(i: int) -> None:
        go.wait()
        try:
            out[i] = body(i)
        except Exception as e:  # collected and asserted on below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "clients still running after the deadline"
    return out


def upload_until_done(up: Uploader, step: int) -> UploadResult:
    """One node's uploader: the real loop (retries with jittered backoff) until ``step`` is
    on tier 2."""
    done = threading.Event()
    last: list[UploadResult] = []

    def finished(r: UploadResult) -> None:
        last.append(r)
        if r.status in DONE:
            done.set()

    watch.run(up, done, poll_s=0.05, watch=True, finished=finished)
    return last[-1]


@pytest.mark.slow
def test_256_uploaders_behind_a_throttled_endpoint_lose_no_save(
        s3_env: S3Env, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    manifests = [make_checkpoint(tmp_path / f"node{i}", 7, SMALL) for i in range(CLIENTS)]
    uploaders = [Uploader(UploaderConfig(tier1=tmp_path / f"node{i}", tier2=f"{s3_env.url}/job{i}",
                                         storage_options=OPTIONS, poll_s=0.05))
                 for i in range(CLIENTS)]  # opened first: their requests then arrive together
    fault_proxy.throttle(RATE, burst=10, retry_after_s=1, warmup=WARMUP)
    try:
        results = run_threads(CLIENTS, lambda i: upload_until_done(uploaders[i], 7),
                              timeout_s=240)
    finally:
        for up in uploaders:
            up.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert {r.status for r in results} <= DONE, results[:3]
    throttled = fault_proxy.actions().count("throttle")
    assert throttled > CLIENTS, f"only {throttled} requests were throttled: the test proves nothing"
    # the refusals reached the uploaders' events (what `tierckpt report` sums), with a wait;
    # all but the few whose answer a loaded client never read (to it, a dropped connection)
    summaries = [uploads.summarize(read_events(tmp_path / f"node{i}" / layout.EVENTS))
                 for i in range(CLIENTS)]
    counted = sum(u.throttled_requests for u in summaries)
    assert 0.95 * throttled <= counted <= throttled, (counted, throttled)
    assert sum(u.throttled_s for u in summaries) > 0
    # one verified upload per node: an attempt whose marker landed but whose read-back was
    # refused to the end fails, and the next finds the same marker (no second upload)
    assert all(u.verified <= 1 for u in summaries)
    assert sum(u.verified for u in summaries) + sum(u.failed for u in summaries) >= CLIENTS
    fault_proxy.throttle(0)
    with open_storage(s3_env.url) as st:  # every step complete and intact, read back
        for i, m in enumerate(manifests):
            cat = Tier2Catalog(open_storage(f"{s3_env.url}/job{i}"))
            assert cat.complete_steps() == [7]
            where = cat.resolve(7)  # content-addressed: each file through the step's map
            assert where.committed.manifest.save_id == m.save_id
            for f in m.files:
                info = st.head(f"job{i}/{where.key(f.name)}")
                assert info is not None and (info.size, info.crc32c) == (f.size, f.crc32c)
            cat.storage.close()


@pytest.mark.slow
def test_a_throttled_list_is_never_read_as_an_empty_tier2(
        s3_env: S3Env, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    steps = [3, 6, 9]
    with open_storage(s3_env.url, **OPTIONS) as st:
        for step in steps:
            make_checkpoint(tmp_path / "t1", step, SMALL)
            for name in (*SMALL, layout.MANIFEST, layout.COMPLETE):
                data = (tmp_path / "t1" / layout.step_dirname(step) / name).read_bytes()
                st.put_bytes(Tier2Catalog.key(step, name), data)
    # A rate well under what 256 listing clients ask: most LISTs are refused at first, and
    # some clients give up after their attempts.
    fault_proxy.throttle(RATE / 2, burst=10, retry_after_s=1)
    stores = [open_storage(s3_env.url, **{**OPTIONS, "max_attempts": 2})
              for _ in range(CLIENTS)]  # opened first: the LISTs then arrive together
    try:
        results = run_threads(CLIENTS, lambda i: Tier2Catalog(stores[i]).complete_steps(),
                              timeout_s=120)
    finally:
        for st in stores:
            st.close()
    answered = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    assert all(r == steps for r in answered), [r for r in answered if r != steps][:3]
    assert all(isinstance(e, StorageError) for e in failed), failed[:3]
    assert fault_proxy.actions().count("throttle") >= CLIENTS // 4 and answered
