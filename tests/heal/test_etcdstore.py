"""tierckpt.runtime.etcdstore: the job's store in etcd, against a real etcd (tests/etcdserver.py):
each operation, TCPStore's semantics side by side, a 2-rank gloo group formed over it, and
the store across an etcd kill -9 and restart, a lost answer, and a lost cluster member."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._launch import spawn
from tests.etcdserver import EtcdCluster, job_id
from tests.faultproxy import FaultProxy
from tierckpt.errors import ConfigError
from tierckpt.runtime.etcdstore import EtcdStore

S = datetime.timedelta(seconds=1)


def _store(cluster: EtcdCluster, job: str | None = None, timeout_s: float = 10.0,
           endpoints: str | None = None) -> EtcdStore:
    return EtcdStore(endpoints or cluster.endpoints, job or job_id(), timeout=timeout_s * S)


@pytest.fixture
def store(etcd_server: EtcdCluster) -> Iterator[EtcdStore]:
    with _store(etcd_server) as s:
        yield s


def _later(delay_s: float, fn: Callable[[], object]) -> threading.Thread:
    t = threading.Timer(delay_s, fn)
    t.start()
    return t


# -- each operation ------------------------------------------------------------------------


def test_set_get_check_delete_num_keys(store: EtcdStore) -> None:
    store.set("a", "1")
    store.set("b", b"\x00\xffbytes")
    store.set("a", "2")  # overwrites
    assert store.get("a") == b"2" and store.get("b") == b"\x00\xffbytes"
    assert store.check(["a", "b"]) and not store.check(["a", "nope"]) and store.check([])
    assert store.num_keys() == 2
    assert store.delete_key("a") is True and store.delete_key("a") is False
    assert not store.check(["a"]) and store.num_keys() == 1


def test_get_blocks_until_another_thread_sets(store: EtcdStore) -> None:
    t0 = time.monotonic()
    setter = _later(0.3, lambda: store.set("late", "here"))
    assert store.get("late") == b"here"
    waited = time.monotonic() - t0
    setter.join()
    assert 0.29 < waited < 2.0  # woken by the watch, not by a poll's period


def test_get_times_out_with_tcpstores_error(etcd_server: EtcdCluster) -> None:
    with _store(etcd_server, timeout_s=0.3) as s:
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=r"wait timeout after 300ms, keys: never "
                           r"\(etcd store of job t-\w+ at http://127\.0\.0\.1:\d+"):
            s.get("never")
        assert 0.29 < time.monotonic() - t0 < 2.0


def test_wait_returns_when_every_key_exists_and_times_out(store: EtcdStore) -> None:
    store.set("k0", "x")
    store.wait(["k0"])  # present: at once
    setters = [_later(0.1, lambda: store.set("k1", "x")), _later(0.3, lambda: store.set("k2", "x"))]
    t0 = time.monotonic()
    store.wait(["k0", "k1", "k2"], 5 * S)
    assert 0.29 < time.monotonic() - t0 < 2.0
    for t in setters:
        t.join()
    with pytest.raises(dist.DistStoreError, match="wait timeout after 200ms, keys: k0, k3"):
        store.wait(["k0", "k3"], 0.2 * S)


def test_wait_on_more_keys_than_one_transaction_holds(store: EtcdStore) -> None:
    keys = [f"many/{i}" for i in range(150)]  # etcd allows 128 operations per transaction
    for k in keys[:-1]:
        store.set(k, "x")
    assert not store.check(keys)
    _later(0.2, lambda: store.set(keys[-1], "x"))
    store.wait(keys, 5 * S)
    assert store.check(keys)


def test_add_counts_and_refuses_a_non_integer(store: EtcdStore) -> None:
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2 and store.add("n", 0) == 2
    assert store.get("n") == b"2"
    assert store.add("zero", 0) == 0 and store.check(["zero"])  # TCPStore creates it too
    store.set("text", "abc")
    with pytest.raises(ValueError, match="'text': it holds b'abc', not an integer"):
        store.add("text", 1)


def test_add_is_atomic_under_8_threads(etcd_server: EtcdCluster) -> None:
    job = job_id()
    stores = [_store(etcd_server, job) for _ in range(8)]  # 8 clients, as 8 processes have
    results: list[list[int]] = [[] for _ in stores]

    def adder(i: int) -> None:
        results[i] = [stores[i].add("counter", 1) for _ in range(100)]

    threads = [threading.Thread(target=adder, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].get("counter") == b"800"
    returned = sorted(v for r in results for v in r)
    assert returned == list(range(1, 801))  # every add saw its own sum: none lost, none twice
    for s in stores:
        s.close()


def test_compare_set_as_tcpstore_does(store: EtcdStore) -> None:
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10 * S)
    steps = [
        ("missing1", "", "d"),        # missing, nothing expected: created
        ("missing2", "e", "d"),       # missing, something expected: answers expected
        ("k", None, "v"),             # (a set)
        ("k", "v", "w"),              # equal: swapped
        ("k", "v", "q"),              # differs: the current value
        ("k", "", "q"),
        ("empty", None, ""),
        ("empty", "", "f"),           # an empty value equals the empty expectation
        ("k", "w", "w"),              # expected == desired
    ]
    got: dict[str, list[Any]] = {"tcp": [], "etcd": []}
    for name, s in (("tcp", tcp), ("etcd", store)):
        for key, expected, desired in steps:
            if expected is None:
                s.set(key, desired)
            else:
                got[name].append(s.compare_set(key, expected, desired))
        got[name].append([s.get(k) for k in ("missing1", "k", "empty")])
        got[name].append(s.check(["missing2"]))
    assert got["etcd"] == got["tcp"]
    assert got["etcd"][0] == b"d" and got["etcd"][1] == b"e"


def test_compare_set_under_contention_lets_one_win(etcd_server: EtcdCluster) -> None:
    job = job_id()
    stores = [_store(etcd_server, job) for _ in range(6)]
    answers: list[bytes] = [b""] * 6

    def claim(i: int) -> None:
        answers[i] = stores[i].compare_set("leader", "", f"rank{i}")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winner = stores[0].get("leader")
    assert set(answers) == {winner}  # every claimant sees the one winner
    for s in stores:
        s.close()


def test_jobs_are_isolated_by_prefix(etcd_server: EtcdCluster) -> None:
    with _store(etcd_server, "job-a") as a, _store(etcd_server, "job-b") as b:
        a.clear()
        b.clear()
        a.set("k", "a")
        b.set("k", "b")
        a.add("n", 5)
        assert a.get("k") == b"a" and b.get("k") == b"b"
        assert b.check(["k"]) and not b.check(["n"])
        assert a.num_keys() == 2 and b.num_keys() == 1
        assert a.clear() >= 2  # its keys and its calls' records
        assert not a.check(["k"]) and b.get("k") == b"b"
        b.clear()


def test_clear_keeps_what_it_is_told_to_in_the_same_transaction(
        etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s, _store(etcd_server, job_id()) as other:
        other.set("k", "theirs")
        s.set("x", "1")
        s.add("y", 2)
        assert s.job_keys()[:2] == ["x", "y"] and any(k.startswith("calls/") for k in s.job_keys())
        assert s.clear(keep={"nodes/done": "0", "nodes/closed": "n1"}) >= 3
        assert s.job_keys() == ["nodes/closed", "nodes/done"]  # the calls' records went too
        assert s.get("nodes/done") == b"0" and other.get("k") == b"theirs"
        assert s.clear(keep={"nodes/done": "0"}) == 1 and s.job_keys() == ["nodes/done"]


def _read_at(cluster: EtcdCluster, key: str, revision: int) -> dict[str, Any]:
    """A raw range of ``key`` as it was at ``revision`` (etcd's JSON gateway)."""
    from tierckpt.runtime._etcd import b64
    body = json.dumps({"key": b64(key.encode()), "revision": str(revision)}).encode()
    req = urllib.request.Request(f"{cluster.url}/v3/kv/range", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return {"error": e.read().decode()}


def test_the_history_is_compacted_one_period_behind_and_readers_go_on(
        etcd_server: EtcdCluster) -> None:
    job = job_id()
    with EtcdStore(etcd_server.endpoints, job, timeout=datetime.timedelta(seconds=10),
                   compact_every_s=0.3) as s:
        s.set("beat", "0")
        old = s.revision()
        key = f"/tierckpt/{job}/kv/beat"
        assert "kvs" in _read_at(etcd_server, key, old)  # the history is there at first
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(s.get("late")))
        reader.start()  # blocked in a watch across the compactions below
        for i in range(40):  # heartbeats for 1.2 s: four periods
            s.set("beat", str(i))
            time.sleep(0.03)
        assert "compacted" in _read_at(etcd_server, key, old).get("error", "")
        assert s.revision() > old and not s.compact(old)  # that far already
        s.set("late", "here")
        reader.join(timeout=10)
        assert got == [b"here"]
    assert s.compact(s.revision())  # by hand, too (the store reopens to do it)
    s.close()


def test_store_keys_live_under_the_job_prefix(etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s:
        s.set("x", "1")
        s.add("y", 1)
        keys = _etcd_keys(etcd_server, b"/")
    assert f"/tierckpt/{job}/kv/x".encode() in keys
    assert all(k.startswith(f"/tierckpt/{job}/".encode()) for k in keys if job.encode() in k)


def test_a_prefix_store_over_it_behaves_as_torch_expects(store: EtcdStore) -> None:
    p = dist.PrefixStore("pg0/", store)
    p.set("a", "1")
    assert p.get("a") == b"1" and p.add("c", 2) == 2 and p.check(["a", "c"])
    p.wait(["a"])
    p.wait(["a"], S)
    assert p.compare_set("a", "1", "2") == b"2"
    assert p.delete_key("a") is True and p.num_keys() == 1  # through C++'s deleteKey, getNumKeys
    store.set_timeout(0.2 * S)
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.get("missing")


# -- configuration and reachability --------------------------------------------------------


def test_bad_endpoints_and_job_ids_say_what_to_give() -> None:
    with pytest.raises(ConfigError, match="give a client URL"):
        EtcdStore("ftp://x:1", "job")
    with pytest.raises(ConfigError, match="no etcd endpoint given"):
        EtcdStore(" , ", "job")
    with pytest.raises(ConfigError, match="without '/'"):
        EtcdStore("http://127.0.0.1:2379", "a/b")


def test_unreachable_endpoints_name_each_url_and_what_to_check() -> None:
    t0 = time.monotonic()
    with pytest.raises(dist.DistNetworkError) as e:
        EtcdStore("127.0.0.1:9,http://127.0.0.1:7", "job", timeout=0.5 * S)
    assert 0.45 < time.monotonic() - t0 < 3.0  # the constructor waits its timeout, as TCPStore
    msg = str(e.value)
    for part in ("http://127.0.0.1:9 (ConnectionRefusedError", "http://127.0.0.1:7 (",
                 "curl <url>/health", "majority"):
        assert part in msg, msg


def test_a_dead_first_endpoint_fails_over_to_the_next(etcd_server: EtcdCluster) -> None:
    with _store(etcd_server, endpoints=f"http://127.0.0.1:9,{etcd_server.url}") as s:
        s.set("k", "v")
        assert s.get("k") == b"v" and s.endpoints[1] == etcd_server.url


def test_close_is_idempotent_and_the_store_reopens(store: EtcdStore) -> None:
    store.set("k", "v")
    store.close()
    store.close()
    assert store.get("k") == b"v"


def test_the_transport_imports_without_torch() -> None:
    """A supervisor or `doctor` may reach the job's etcd before importing torch."""
    code = "import sys, tierckpt.runtime._etcd; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- outages -------------------------------------------------------------------------------


def test_a_lost_answer_is_not_applied_twice(etcd_server: EtcdCluster) -> None:
    """etcd applies the transaction, and its answer never arrives (the connection resets):
    the retry recognises its own write instead of applying it again. Through a proxy that
    forwards each call's first transaction and drops etcd's answer; then retries that meet
    lost answers and a 503 in a row."""
    host, port = etcd_server.url.removeprefix("http://").split(":")
    with FaultProxy(host, int(port)) as proxy, _store(etcd_server, endpoints=proxy.endpoint) as s:
        s.set("gone", "x")
        ops: list[tuple[Callable[[], object], object]] = [
            (lambda: s.add("n", 5), 5), (lambda: s.add("n", 2), 7),
            (lambda: s.compare_set("c", "", "mine"), b"mine"),
            (lambda: s.delete_key("gone"), True)]
        for op, expected in ops:
            rule = proxy.add_rule("reset_after_store", method="POST", path="/v3/kv/txn")
            assert op() == expected
            assert rule.fired == 1
        rules = [proxy.add_rule("reset_after_store", method="POST", path="/v3/kv/txn", times=3),
                 proxy.add_rule("status", method="POST", path="/v3/kv/txn", status=503)]
        assert s.add("n", 1) == 8
        assert [r.fired for r in rules] == [3, 1]
        assert s.get("n") == b"8" and s.get("c") == b"mine" and not s.check(["gone"])


def test_etcd_killed_and_restarted_the_store_waits_and_goes_on(
        etcd_cluster: Callable[[int], EtcdCluster]) -> None:
    """The decision (docs in the module): an operation during an outage waits and succeeds
    once etcd is back within the store's timeout; a blocked get sees a key set after the
    restart; what was written before the kill is still there (same data dir and port)."""
    cluster = etcd_cluster(1)
    job = job_id()
    with _store(cluster, job, timeout_s=15) as s, _store(cluster, job, timeout_s=15) as other:
        s.set("before", "1")
        s.add("n", 1)
        cluster.kill(0)
        results: dict[str, Any] = {}

        def during() -> None:
            s.set("during", "2")
            results["set"] = "done"
            results["add"] = s.add("n", 1)
            results["get"] = s.get("after")  # blocks until `other` sets it after the restart

        t = threading.Thread(target=during)
        t0 = time.monotonic()
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # waiting out the outage, not failed
        cluster.restart(0)
        other.set("after", "3")
        t.join(15)
        assert not t.is_alive() and results == {"set": "done", "add": 2, "get": b"3"}
        assert time.monotonic() - t0 < 5
        assert [s.get(k) for k in ("before", "during", "n")] == [b"1", b"2", b"2"]


def test_an_outage_past_the_timeout_raises_the_network_error(
        etcd_cluster: Callable[[int], EtcdCluster]) -> None:
    cluster = etcd_cluster(1)
    with _store(cluster, timeout_s=0.5) as s:
        s.set("k", "v")
        cluster.kill(0)
        for op in (lambda: s.set("k", "w"), lambda: s.get("k"), lambda: s.add("n", 1)):
            t0 = time.monotonic()
            with pytest.raises(dist.DistNetworkError, match=rf"{cluster.url} \(Connection"):
                op()
            assert 0.45 < time.monotonic() - t0 < 3.0
        cluster.restart(0)
        assert s.get("k") == b"v"  # the same store object works again


def test_a_3_member_cluster_loses_its_leader_and_the_store_goes_on(
        etcd_cluster: Callable[[int], EtcdCluster]) -> None:
    cluster = etcd_cluster(3)
    job = job_id()
    leader = _leader(cluster)
    # the leader first in the list: the store talks to it until it dies
    order = [leader, *(i for i in range(3) if i != leader)]
    endpoints = ",".join(cluster.members[i].url for i in order)
    with _store(cluster, job, endpoints=endpoints) as s:
        s.set("k", "v")
        waiter: dict[str, bytes] = {}
        t = threading.Thread(target=lambda: waiter.update(v=s.get("later")))
        t.start()
        cluster.kill(leader)
        t0 = time.monotonic()
        assert s.add("n", 1) == 1  # a new leader is elected; the store moved to a survivor
        recovered = time.monotonic() - t0
        s.set("later", "x")
        t.join(10)
        assert waiter == {"v": b"x"} and s.get("k") == b"v"
        # about one request timeout (1 s) and an election: well inside the store's timeout
        assert recovered < 6, recovered


# -- torch.distributed over it -------------------------------------------------------------


def _all_reduce_over_etcd(rank: int, endpoints: str, job: str) -> None:
    store = EtcdStore(endpoints, job, timeout=60 * S)
    t0 = time.monotonic()
    dist.init_process_group("gloo", store=dist.PrefixStore("pg0/", store), rank=rank,
                            world_size=2, timeout=60 * S)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    took = time.monotonic() - t0
    dist.destroy_process_group()
    store.set(f"result/{rank}", json.dumps({"sum": t.item(), "init_s": took}))
    store.close()


def test_a_gloo_group_forms_over_it_and_all_reduces(etcd_server: EtcdCluster) -> None:
    job = job_id()
    spawn(_all_reduce_over_etcd, etcd_server.endpoints, job)
    with _store(etcd_server, job) as s:
        results = [json.loads(s.get(f"result/{r}")) for r in range(2)]
    assert [r["sum"] for r in results] == [3.0, 3.0]


# -- helpers -------------------------------------------------------------------------------


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def _etcd_keys(cluster: EtcdCluster, prefix: bytes) -> list[bytes]:
    import base64

    from tierckpt.runtime._etcd import prefix_end
    answer = _post(cluster.url, "/v3/kv/range", {
        "key": base64.b64encode(prefix).decode(),
        "range_end": base64.b64encode(prefix_end(prefix)).decode(), "keys_only": True})
    return [base64.b64decode(kv["key"]) for kv in answer.get("kvs", [])]


def _leader(cluster: EtcdCluster) -> int:
    """The index of the member that leads the cluster now."""
    status = _post(cluster.url, "/v3/maintenance/status", {})
    for i, m in enumerate(cluster.members):
        if _post(m.url, "/v3/maintenance/status", {})["header"]["member_id"] == status["leader"]:
            return i
    raise AssertionError(f"no member is the leader {status['leader']}")
