"""The nodes of a multi-node ``tierckpt run --heal`` job, kept in the job's store (etcd:
:class:`tierckpt.runtime.etcdstore.EtcdStore`), so that no node is needed to know them.
Torch-free (the store passed in may be any object with the ``Store`` methods used here).

Keys, under ``nodes/`` of the job's store:

=================  =========================================================================
``count``          a counter: nodes registered so far; node k's id is ``id/<k>``
``id/<k>``         the id of the k-th node to register
``hb/<node>``      a counter the node's supervisor adds 1 to every ``beat_s`` (its heartbeat)
``slot/<s>``       the node that runs group rank s (ranks s*P .. s*P + P - 1); empty: free.
                   Taken with ``compare_set`` only: from empty at the start, from a lost
                   node by a spare; a node that finds its slot taken is fenced off
``inc``            the job's incarnation: n after n full restarts (``compare_set`` n → n + 1
                   is a full restart of every node)
``done``           the job's exit status once a node ended it (0: finished)
``left/<node>``    the node's supervisor ended (:meth:`Membership.leave`)
``closed``         the node that cleared the job's keys at its end; ``done`` and ``closed``
                   are all that stay (a job id that ended is never taken for a new job)
=================  =========================================================================

Liveness needs no synchronised clocks: each observer times, on its own monotonic clock, how
long a node's heartbeat counter has not moved; ``detect_s`` without a change is a lost node.
The observer's clock is also counted in its own heartbeats that landed: a store whose writes
stall (an election, a slow disk under etcd's fsync) stalls every heartbeat, the observer's
too, so silence does not grow then and no node is taken for lost because the store was slow.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Protocol

BEAT_S = 0.25
"""Heartbeat period."""


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the membership uses."""

    def add(self, key: str, amount: int) -> int: ...
    def get(self, key: str) -> bytes: ...
    def set(self, key: str, value: str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> Any: ...


def key(name: str) -> str:
    """A membership key (see the module docstring)."""
    return f"nodes/{name}"


class Membership:
    """This node in the job's membership: it registers ``node`` and heartbeats from a
    daemon thread until :meth:`close`; :meth:`lost` says which nodes have not beaten for
    ``detect_s``. A context manager; ``close`` is idempotent."""

    def __init__(self, store: Store, node: str, *, detect_s: float,
                 beat_s: float = BEAT_S) -> None:
        self.store, self.node, self.detect_s, self.beat_s = store, node, detect_s, beat_s
        # node -> (its beat, when it last moved, this node's beats landed by then)
        self._seen: dict[str, tuple[int, float, int]] = {}
        self._landed = 0  # this node's heartbeats the store took (the heartbeat thread's)
        self._looked = time.monotonic()  # when this node last read a heartbeat
        self._ids: list[str] = []
        self._stop = threading.Event()
        store.add(key(f"hb/{node}"), 1)
        k = store.add(key("count"), 1) - 1
        store.set(key(f"id/{k}"), node)
        self._beat = threading.Thread(target=self._beating, name="tierckpt-heartbeat",
                                      daemon=True)
        self._beat.start()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop beating (the node will be seen lost ``detect_s`` later unless the job is
        done)."""
        self._stop.set()
        if self._beat.is_alive() and self._beat is not threading.current_thread():
            self._beat.join(timeout=5 * self.beat_s + 1)

    def _beating(self) -> None:
        while not self._stop.wait(self.beat_s):
            # an outage longer than the store's timeout: the others see this node lost and
            # take its slot; the fence then ends its workers
            with contextlib.suppress(Exception):
                self.store.add(key(f"hb/{self.node}"), 1)
                self._landed += 1

    # -- who is there ----------------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Every node registered so far, in registration order."""
        count = int(self.store.get(key("count")))
        for k in range(len(self._ids), count):
            self._ids.append(self.store.get(key(f"id/{k}")).decode())
        return list(self._ids)

    def silent(self, node: str) -> float:
        """Seconds since ``node``'s heartbeat last moved, as this node saw it (0 for a node
        first seen now), and at most one heartbeat period more than the heartbeats this node
        landed meanwhile take (while it beats): a store whose writes stall, or a stall of
        this node, is not a silence of the others. A gap of more than four heartbeats in this
        node's own reads (the store was out for everyone, or this node stalled) starts every
        count again, so that an outage of the store is never taken for the loss of every
        node."""
        beat = int(self.store.get(key(f"hb/{node}")))
        now, landed = time.monotonic(), self._landed
        if now - self._looked > 4 * self.beat_s:  # this node looked away (a store outage,
            self._seen.clear()                   # or it was descheduled): judge afresh
        self._looked = now
        last = self._seen.get(node)
        if last is None or last[0] != beat:
            self._seen[node] = (beat, now, landed)
            return 0.0
        if self._stop.is_set():  # not beating (closed): the monotonic clock alone
            return now - last[1]
        return min(now - last[1], (landed - last[2] + 1) * self.beat_s)

    def alive(self, node: str) -> bool:
        """Whether ``node``'s heartbeat moved within ``detect_s`` (see :meth:`silent`)."""
        return self.silent(node) < self.detect_s

    def owner(self, slot: int) -> str:
        """The node that holds ``slot`` ('' when free)."""
        k = key(f"slot/{slot}")
        return self.store.get(k).decode() if self.store.check([k]) else ""

    def claim(self, slot: int, holder: str = "") -> bool:
        """Take ``slot`` from ``holder`` ('' : a free slot); True when this node holds it
        now (also when it already did)."""
        got = self.store.compare_set(key(f"slot/{slot}"), holder, self.node)
        return bytes(got).decode() == self.node

    def release(self, slot: int, holder: str) -> bool:
        """Free ``slot`` if ``holder`` (a lost node) still holds it; False when it did not
        (a spare node took the slot first: one ``compare_set`` or the other wins)."""
        return bytes(self.store.compare_set(key(f"slot/{slot}"), holder, "")) == b""

    def spares(self, nslots: int) -> list[str]:
        """Live nodes that hold no slot (warm spare nodes), this one excluded."""
        owners = {self.owner(s) for s in range(nslots)}
        return [n for n in self.nodes() if n != self.node and n not in owners
                and self.alive(n)]

    # -- the job's incarnation and end -----------------------------------------------------
    def incarnation(self) -> int:
        """The job's incarnation number (0 until the first full restart). A read, once
        the key exists (the supervisors poll it)."""
        if not self.store.check([key("inc")]):
            self.store.compare_set(key("inc"), "", "0")
        return int(self.store.get(key("inc")))

    def restart(self, seen: int) -> int:
        """Ask for a full restart after incarnation ``seen`` (once per incarnation, whoever
        asks); the incarnation now."""
        self.store.compare_set(key("inc"), str(seen), str(seen + 1))
        return int(self.store.get(key("inc")))

    def done(self) -> int | None:
        """The job's exit status once a node ended it, else None."""
        k = key("done")
        return int(self.store.get(k)) if self.store.check([k]) else None

    def end(self, status: int) -> None:
        """Record the job's end (the first status recorded stays)."""
        self.store.compare_set(key("done"), "", str(status))

    def leave(self, poll_s: float = BEAT_S / 2) -> bool:
        """Count this node out (``left/<node>``) once its part of the job ended; True when
        it is the last node to go, the one to clear the job's keys: every other registered
        node has left or is lost (its heartbeat did not move for ``detect_s`` while this
        node watched). False as soon as another node that has not left is seen beating (it
        goes later, and clears), or when the keys are cleared already. Waits at most
        ``detect_s`` and two heartbeats (a lost node's silence must be seen). This node's
        heartbeat stops first: once ``left/<node>`` is there, it writes nothing more, so a
        clear by the last node is not followed by a heartbeat key of its own."""
        self.close()
        if self.store.check([key("closed")]):
            return False
        self.store.set(key(f"left/{self.node}"), "1")
        first: dict[str, int] = {}  # node -> its heartbeat when this node first looked
        deadline = time.monotonic() + self.detect_s + 2 * self.beat_s
        while not self.store.check([key("closed")]):
            pending = [n for n in self.nodes() if n != self.node
                       and not self.store.check([key(f"left/{n}")])]
            beats = {n: int(self.store.get(key(f"hb/{n}"))) for n in pending}
            if any(n in first and first[n] != b for n, b in beats.items()):
                return False
            if not pending or time.monotonic() >= deadline:
                return True
            first = {**beats, **first}
            time.sleep(poll_s)
        return False
