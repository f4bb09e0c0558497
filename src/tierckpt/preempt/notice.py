"""A termination notice and the box every source posts it to.

A *notice* says the job will be killed soon: a signal (SIGTERM from Kubernetes or Slurm,
SIGUSR1 from Slurm's ``--signal``), a trigger file written by a sidecar or a preStop hook, or
a cloud metadata answer (AWS spot ``instance-action``, GCP ``preempted``). It carries a
*deadline*: when the hard kill is expected, from the source when it says so, else the
receipt time plus the configured grace.

:class:`NoticeBox` keeps the first notice (later ones are counted, never replace it). Its
:meth:`NoticeBox.post` takes no lock, allocates nothing beyond the notice and does no I/O,
so a signal handler may call it: Python runs handlers in the main thread between bytecodes,
and a handler that waited for a lock the interrupted code holds would deadlock.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class Notice:
    """One termination notice. ``source``: ``signal:SIGTERM``, ``file:<path>``, ``aws``,
    ``gcp`` or ``rank:<r>`` (another rank's notice, seen through the job's store).
    Times are wall-clock seconds since the epoch."""

    source: str
    received_unix: float
    deadline_unix: float
    detail: str = ""

    @classmethod
    def now(cls, source: str, *, grace_s: float, deadline_unix: float | None = None,
            detail: str = "", clock: Any = time.time) -> Notice:
        """A notice received now; its deadline is the source's, or now + ``grace_s``."""
        t = float(clock())
        return cls(source=source, received_unix=t,
                   deadline_unix=t + grace_s if deadline_unix is None else deadline_unix,
                   detail=detail)

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds left before the deadline (negative once it passed)."""
        return self.deadline_unix - (time.time() if now is None else now)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Notice:
        return cls(source=str(d["source"]), received_unix=float(d["received_unix"]),
                   deadline_unix=float(d["deadline_unix"]), detail=str(d.get("detail", "")))


class NoticeBox:
    """Where every notice source of one process posts. The first notice is kept
    (:attr:`first`); the count of all of them is :attr:`posted`. Safe to call from a signal
    handler and from any thread: one attribute store, no lock (a lost race between two
    sources keeps one of the two first notices, which is all that is promised)."""

    def __init__(self) -> None:
        self.first: Notice | None = None
        self.posted = 0

    def post(self, notice: Notice) -> bool:
        """Record ``notice``; True if it is the first one."""
        self.posted += 1
        if self.first is None:
            self.first = notice
            return True
        return False
