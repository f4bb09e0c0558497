"""The job's store in etcd: a ``torch.distributed.Store`` that outlives any node of the job
(issue 43), for ``init_process_group(store=PrefixStore(..., EtcdStore(...)))``, gloo's
rendezvous and the heal launcher's keys (:mod:`tierckpt.heal.regroup`).

Where the keys are: every key ``k`` of job ``J`` is the etcd key ``/tierckpt/J/kv/k``; the
exactly-once records of :meth:`EtcdStore.add`, :meth:`EtcdStore.compare_set` and
:meth:`EtcdStore.delete_key` are ``/tierckpt/J/calls/<client>``, one per client thread.
Two jobs never see each other's keys; :meth:`EtcdStore.clear` deletes a job's.

Contracts, as ``TCPStore`` keeps them unless said otherwise:

- **Linearizable.** Every read and write goes through etcd's raft leader, so every process
  sees one order of writes, whichever member it talks to.
- **Blocking reads.** :meth:`~EtcdStore.get` and :meth:`~EtcdStore.wait` block until the keys
  exist (an etcd watch wakes them) or the timeout passes, then raise
  ``torch.distributed.DistStoreError`` ("wait timeout after …ms, keys: …") as TCPStore does.
- **Atomic, exactly once.** ``add`` and ``compare_set`` are transactions on the key's
  revision, retried on contention; each also records its call, so a retry after a lost
  answer (etcd killed after it applied the write) recognises its own write and never applies
  it twice.
- **Outages wait.** An operation retries across the endpoints until the store's timeout
  (``timeout``, :meth:`set_timeout`) from its start: an etcd restarted, or a member of a
  3-member cluster lost (the others elect a leader within about one election timeout),
  within that time is invisible to the caller. Past it, ``torch.distributed.
  DistNetworkError`` (TCPStore's error for a lost server) names every URL, what each
  answered and what to check. Consequence: a ``set`` repeated over a reconnect may land
  after another process's ``set`` of the same key (last writer wins, as with any retry).
- **Sizes:** a value up to etcd's request limit (1.5 MiB by default, ``--max-request-bytes``).
- **History** (``compact_every_s``): etcd keeps every revision of every key until it is
  compacted, and a node's heartbeat is ~4 revisions a second (~115 MB of etcd database per
  node per day, measured; etcd stops taking writes at its quota, 2 GiB by default). A store
  given ``compact_every_s`` compacts, every that many seconds, the history older than the
  revision it saw one period before (what kube-apiserver does every 5 minutes); a watch
  from a compacted revision is only a wake-up here, so readers never notice.

Not provided: TCPStore's queues (``queue_push``/``queue_pop``), ``append`` and ``multi_*``
fall back to torch's default implementations over these operations. An etcd with TLS client
certificates or authentication is not supported (the JSON gateway over plain HTTP, or HTTPS
with the system's trust store).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tierckpt.errors import ConfigError
from tierckpt.runtime._etcd import MAX_TXN_OPS, EtcdClient, b64, prefix_end, unb64

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
"""TCPStore's default: how long an operation waits for its keys or for etcd."""

_KV = "/v3/kv"
_log = logging.getLogger("tierckpt")


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` over etcd v3 for job ``job_id`` (see the module
    docstring for the contracts).

    ``endpoints``: the client URLs of the etcd members, comma-separated or a list
    (``http://10.0.0.1:2379,http://10.0.0.2:2379,...``); a connection error moves to the
    next. ``timeout``: the store's timeout (TCPStore's default, 300 s). The constructor
    waits up to ``timeout`` for an endpoint to answer, then raises ``DistNetworkError``;
    a bad endpoint or job id raises ``ConfigError``. Thread-safe; ``close()`` (or ``with``)
    closes its connections, and the store reopens them if used again."""

    def __init__(self, endpoints: str | Sequence[str], job_id: str, *,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                 compact_every_s: float | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        if not job_id or "/" in job_id:
            raise ConfigError(f"job id {job_id!r}: give a non-empty name without '/' "
                              "(the store's keys live under /tierckpt/<job id>/)")
        try:
            self._client = EtcdClient(endpoints)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.job_id = job_id
        self._root = f"/tierckpt/{job_id}/".encode()
        self._kv = self._root + b"kv/"
        self._client_id = uuid.uuid4().hex[:16]
        self._seen: dict[bytes, tuple[int, int]] = {}  # add's first guess: (revision, value)
        self.set_timeout(timeout)
        self._call("range", {"key": b64(self._kv), "range_end": b64(prefix_end(self._kv)),
                             "count_only": True}, self._deadline(None))
        self._trim = threading.Event()  # set: the history thread stops
        if compact_every_s is not None:
            threading.Thread(target=self._compacting, args=(compact_every_s,),
                             name="tierckpt-etcd-history", daemon=True).start()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections to etcd and stop compacting (idempotent); the keys stay."""
        self._trim.set()
        self._client.close()

    def revision(self) -> int:
        """etcd's current revision (of the whole cluster, not only this job's keys)."""
        return _revision(self._call("range", {"key": b64(self._kv), "count_only": True},
                                    self._deadline(None)))

    def compact(self, revision: int) -> bool:
        """Drop etcd's history before ``revision`` (cluster-wide, as etcd compacts); False
        when it was compacted that far already."""
        try:
            self._call("compaction", {"revision": str(revision)}, self._deadline(None))
        except dist.DistStoreError as e:
            if "compacted" in str(e):
                return False
            raise
        return True

    def _compacting(self, every_s: float) -> None:
        """The history thread: compact to the revision seen one period ago, every period."""
        seen: int | None = None
        while not self._trim.wait(every_s):
            try:
                now = self.revision()
                if seen is not None and seen < now:
                    self.compact(seen)
                seen = now
            except Exception as e:  # etcd out: the next period tries again
                _log.debug("etcd history not compacted: %s", e)

    @property
    def endpoints(self) -> list[str]:
        """The etcd client URLs, in the order given (tried from the one that answered last)."""
        return list(self._client.endpoints)

    # -- the Store interface ---------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value`` under ``key`` (overwrites)."""
        self._call("put", {"key": b64(self._key(key)), "value": b64(_bytes(value))},
                   self._deadline(None))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting until it exists or the store's timeout passes
        (then ``DistStoreError``)."""
        deadline, k = self._deadline(None), self._key(key)
        while True:
            answer = self._call("range", {"key": b64(k)}, deadline)
            kvs = answer.get("kvs")
            if kvs:
                return unb64(kvs[0].get("value"))
            self._await(k, _revision(answer), deadline, [key], self._timeout)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer under ``key`` (0 if missing) and return the sum;
        atomic and applied once. ``ValueError`` if the key holds something else."""
        k, deadline = self._key(key), self._deadline(None)
        mod, current = self._seen.get(k, (0, 0))  # first guess: as this store left it, or new
        while True:
            new = current + int(amount)
            revision, kv = self._once(k, {"target": "MOD", "mod_revision": str(mod)},
                                      [{"request_put": {"key": b64(k),
                                                        "value": b64(str(new).encode())}}],
                                      deadline)
            if revision:
                if len(self._seen) > 10_000:  # a bound, not a policy: any guess is only a guess
                    self._seen.clear()
                self._seen[k] = (revision, new)
                return new
            mod, current = _revision_of(kv), _int(key, kv)

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """TCPStore's semantics: when ``key`` holds ``expected_value`` (or is missing and
        ``expected_value`` is empty), write ``desired_value`` and return it; otherwise
        return the current value, or ``expected_value`` when the key is missing."""
        k, deadline = self._key(key), self._deadline(None)
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        put = [{"request_put": {"key": b64(k), "value": b64(desired)}}]
        compare: dict[str, Any] = {"target": "VALUE", "value": b64(expected)}
        while True:
            revision, kv = self._once(k, compare, put, deadline)
            if revision:
                return desired
            if kv is not None:
                value = unb64(kv.get("value"))
                if value != expected:
                    return value
                compare = {"target": "MOD", "mod_revision": str(_revision_of(kv))}
            elif expected:
                return expected
            else:  # missing and nothing expected: create it, unless another process does
                compare = {"target": "MOD", "mod_revision": "0"}

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True when this call deleted it, False when it did not exist."""
        k = self._key(key)
        revision, _ = self._once(
            k, {"target": "CREATE", "result": "GREATER", "create_revision": "0"},
            [{"request_delete_range": {"key": b64(k)}}], self._deadline(None))
        return bool(revision)

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists now (no waiting for the keys; an outage still waits up
        to the timeout)."""
        return self._first_missing([self._key(k) for k in keys], self._deadline(None)) is None

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Return once every key exists; ``DistStoreError`` after ``timeout`` (the store's
        by default)."""
        deadline = self._deadline(timeout)
        ks = [self._key(k) for k in keys]
        while (missing := self._first_missing(ks, deadline)) is not None:
            k, revision = missing
            self._await(k, revision, deadline, keys,
                        self._timeout if timeout is None else timeout)

    def num_keys(self) -> int:
        """How many keys the job's store holds."""
        answer = self._call("range", {"key": b64(self._kv), "range_end": b64(
            prefix_end(self._kv)), "count_only": True}, self._deadline(None))
        return int(answer.get("count", 0))

    # torch's C++ side calls these two by their C++ names
    deleteKey = delete_key
    getNumKeys = num_keys

    def clear(self, keep: dict[str, str] | None = None) -> int:
        """Delete every key of this job (its calls' records too) and write ``keep`` (key ->
        value) back, in one transaction: no reader sees the job half cleared, and two
        clears at once end alike. The number of keys deleted. For the launcher, once the
        job is over."""
        kept = sorted((self._key(k), _bytes(v)) for k, v in (keep or {}).items())
        # etcd refuses a put inside a range the same transaction deletes: delete around them
        bounds = [self._root, *(k + b"\0" for k, _ in kept)]
        ends = [*(k for k, _ in kept), prefix_end(self._root)]
        ops: list[dict[str, Any]] = [
            {"request_delete_range": {"key": b64(a), "range_end": b64(b)}}
            for a, b in zip(bounds, ends, strict=True)]
        ops += [{"request_put": {"key": b64(k), "value": b64(v)}} for k, v in kept]
        answer = self._call("txn", {"success": ops}, self._deadline(None))
        return sum(int(r.get("response_delete_range", {}).get("deleted", 0))
                   for r in answer.get("responses") or [])

    def job_keys(self) -> list[str]:
        """Every key of this job, sorted: the keys as ``set`` names them, then the call
        records as ``calls/<client>`` (what :meth:`clear` deletes)."""
        answer = self._call("range", {"key": b64(self._root), "range_end": b64(
            prefix_end(self._root)), "keys_only": True}, self._deadline(None))
        names = [unb64(kv.get("key"))[len(self._root):].decode()
                 for kv in answer.get("kvs") or []]
        return sorted(n.removeprefix("kv/") for n in names if n.startswith("kv/")) + sorted(
            n for n in names if not n.startswith("kv/"))

    # -- the parts -------------------------------------------------------------------------

    @property
    def _timeout(self) -> datetime.timedelta:
        """The store's timeout, which ``set_timeout`` changes (torch's stub lacks the
        ``Store.timeout`` property that torch has)."""
        value: datetime.timedelta = self.timeout  # type: ignore[attr-defined]
        return value

    def _key(self, key: str | bytes) -> bytes:
        return self._kv + _bytes(key)

    def _deadline(self, timeout: datetime.timedelta | None) -> float:
        return time.monotonic() + (self._timeout if timeout is None else timeout
                                   ).total_seconds()

    def _call(self, op: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """One request, with the transport's errors as TCPStore's."""
        try:
            return self._client.call(f"{_KV}/{op}", body, deadline)
        except ConnectionError as e:
            raise dist.DistNetworkError(f"etcd store of job {self.job_id}: {e}") from None
        except RuntimeError as e:
            raise dist.DistStoreError(f"etcd store of job {self.job_id}: {e}") from None

    def _once(self, k: bytes, compare: dict[str, Any], ops: list[dict[str, Any]],
              deadline: float) -> tuple[int, dict[str, Any] | None]:
        """Run ``ops`` on ``k`` if ``compare`` holds, recording this call in the same
        transaction. Returns the revision at which this call applied them (0 if it did not)
        and, when it did not, the key's kv (None: missing). An earlier try of the same
        request whose answer was lost counts as applied: the record says so."""
        call = b64(uuid.uuid4().hex.encode())
        record = b64(self._root + f"calls/{self._client_id}-{threading.get_ident()}".encode())
        answer = self._call("txn", {
            "compare": [{"key": b64(k), "result": compare.get("result", "EQUAL"), **compare}],
            "success": [*ops, {"request_put": {"key": record, "value": call}}],
            "failure": [{"request_range": {"key": b64(k)}},
                        {"request_range": {"key": record}}]}, deadline)
        if answer.get("succeeded"):
            return _revision(answer), None
        got = [r.get("response_range", {}).get("kvs") or [None] for r in answer["responses"]]
        kv, mine = got[0][0], got[1][0]
        if mine is not None and mine.get("value") == call:
            return _revision_of(mine), None
        return 0, kv

    def _first_missing(self, ks: list[bytes], deadline: float) -> tuple[bytes, int] | None:
        """The first of ``ks`` that does not exist, with the revision at which it did not;
        None when all exist."""
        for i in range(0, len(ks), MAX_TXN_OPS):
            chunk = ks[i:i + MAX_TXN_OPS]
            answer = self._call("txn", {"success": [
                {"request_range": {"key": b64(k), "count_only": True}} for k in chunk]},
                deadline)
            for k, r in zip(chunk, answer["responses"], strict=True):
                if not int(r.get("response_range", {}).get("count", 0)):
                    return k, _revision(answer)
        return None

    def _await(self, k: bytes, revision: int, deadline: float, keys: list[str],
               timeout: datetime.timedelta) -> None:
        """Sleep until ``k`` may have appeared after ``revision``; DistStoreError at the
        deadline, as TCPStore words it."""
        if time.monotonic() >= deadline:
            ms = int(timeout.total_seconds() * 1000)
            raise dist.DistStoreError(
                f"wait timeout after {ms}ms, keys: {', '.join(keys)} (etcd store of job "
                f"{self.job_id} at {self._client.url}: no process set them in time)")
        self._client.watch(k, revision + 1, deadline)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _revision(answer: dict[str, Any]) -> int:
    """The store revision an answer was read at."""
    return int(answer.get("header", {}).get("revision", 0))


def _revision_of(kv: dict[str, Any] | None) -> int:
    return int(kv.get("mod_revision", 0)) if kv else 0


def _int(key: str, kv: dict[str, Any] | None) -> int:
    raw = unb64(kv.get("value")) if kv else b"0"
    try:
        return int(raw or b"0")
    except ValueError:
        raise ValueError(f"add on key {key!r}: it holds {raw[:40]!r}, not an integer") from None
