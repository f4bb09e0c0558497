"""Run a call that may hang (a dead NFS mount, an unreachable object store) with a deadline.

The call runs in a daemon thread; when the deadline passes, :func:`call_with_deadline`
raises :class:`TimeoutError` and the caller goes on without the result. A thread stuck in the
kernel cannot be cancelled, so it is abandoned (it ends when its syscall returns, or with the
process) — the price of never letting an optional dependency block a restart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()``, or :class:`TimeoutError` naming ``what`` when it takes longer than
    ``timeout_s`` seconds. ``fn``'s own exception is re-raised unchanged."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"tierckpt-deadline-{what[:20]}", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{what}: no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
