"""The bounded thread pool the object-store backends run parallel parts and ranges on.

One call, :func:`run_bounded`, shared by the S3, GCS and Azure backends (each binds its
``max_concurrency`` and a thread name in a one-line ``_parallel``).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import TypeVar

__all__ = ["run_bounded"]

T = TypeVar("T")
U = TypeVar("U")


def run_bounded(items: list[U], fn: Callable[[U], T], *, workers: int,
                name: str) -> list[T]:
    """``[fn(i) for i in items]`` on at most ``workers`` threads named ``name``, results
    in the order of ``items``.

    The first failure cancels the calls not yet started and is raised once every started
    call has returned (so no worker still writes into the caller's file or buffer). One
    item, or none, runs on the calling thread."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with cf.ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix=name) as ex:
        futs = [ex.submit(fn, i) for i in items]
        _done, pending = cf.wait(futs, return_when=cf.FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                cf.wait(futs)
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futs]
