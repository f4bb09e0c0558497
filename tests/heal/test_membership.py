"""tierckpt.heal.membership on a real etcd: registration and heartbeats, slots taken once
with compare_set, a silent node seen lost, the job's incarnation and end."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

from tests.etcdserver import EtcdCluster, job_id
from tierckpt.heal.membership import Membership
from tierckpt.runtime.etcdstore import EtcdStore


def _store(etcd: EtcdCluster, job: str) -> EtcdStore:
    return EtcdStore(etcd.endpoints, job, timeout=datetime.timedelta(seconds=10))


def test_slots_are_taken_once_and_from_a_lost_holder_only(etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s, Membership(s, "a", detect_s=1.0) as a, \
            Membership(s, "b", detect_s=1.0) as b:
        assert a.nodes() == ["a", "b"] and b.nodes() == ["a", "b"]
        assert a.claim(0) and not b.claim(0) and a.claim(0)  # held: taking again is a no-op
        assert b.owner(0) == "a" and b.owner(1) == ""
        assert not b.claim(0, "c")  # not held by c
        assert b.claim(0, "a") and a.owner(0) == "b"  # a was lost: b takes its slot
        assert not b.release(0, "a")  # a no longer holds it: nothing freed (b took it)
        assert a.owner(0) == "b"
        assert b.release(0, "b")
        assert a.owner(0) == ""


def test_a_node_that_stops_beating_is_silent_and_then_not_alive(
        etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s, Membership(s, "watcher", detect_s=0.6,
                                                   beat_s=0.05) as w:
        gone = Membership(s, "gone", detect_s=0.6, beat_s=0.05)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # beating: never silent long
            assert w.silent("gone") < 0.3
            time.sleep(0.05)
        gone.close()
        time.sleep(0.1)
        t0 = time.monotonic()
        while w.alive("gone"):
            time.sleep(0.05)
            assert time.monotonic() - t0 < 3
        assert 0.4 < time.monotonic() - t0 < 1.5
        assert w.spares(0) == []  # only live nodes are spares (and never itself)


def test_a_gap_in_the_watchers_own_reads_starts_the_count_again(
        etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s, Membership(s, "w", detect_s=0.5, beat_s=0.05) as w:
        quiet = Membership(s, "q", detect_s=0.5, beat_s=0.05)
        quiet.close()
        w.silent("q")
        time.sleep(1.0)  # the watcher looked away (a store outage, a stall)
        assert w.silent("q") == 0.0 and w.alive("q")


class _StalledWrites:
    """The real store, with this node's heartbeat writes held while ``stall`` is set (an
    etcd election or fsync stall, made to happen on demand: every write waits alike)."""

    def __init__(self, store: EtcdStore) -> None:
        self.store, self.stall = store, threading.Event()

    def add(self, key: str, amount: int) -> int:
        while self.stall.is_set():
            time.sleep(0.01)
        return self.store.add(key, amount)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_store_whose_writes_stall_is_not_every_node_lost(etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s:
        slow = _StalledWrites(s)
        with Membership(slow, "w", detect_s=0.5, beat_s=0.05) as w:
            Membership(s, "q", detect_s=0.5, beat_s=0.05).close()  # silent from now on
            slow.stall.set()
            end = time.monotonic() + 1.0  # twice detect_s: the watcher's own beats held
            while time.monotonic() < end:
                assert w.silent("q") <= 0.05 and w.alive("q")
                time.sleep(0.02)
            slow.stall.clear()
            t0 = time.monotonic()
            while w.alive("q"):  # the store takes writes again: q's silence counts
                time.sleep(0.02)
                assert time.monotonic() - t0 < 3
            assert time.monotonic() - t0 >= 0.4


def test_one_full_restart_per_incarnation_and_the_first_end_stays(
        etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s, Membership(s, "a", detect_s=1.0) as a, \
            Membership(s, "b", detect_s=1.0) as b:
        assert a.incarnation() == 0 and b.incarnation() == 0
        assert a.restart(0) == 1 and b.restart(0) == 1  # both asked: one restart
        assert b.restart(1) == 2
        assert a.done() is None
        a.end(0)
        b.end(1)
        assert b.done() == 0


def test_the_last_node_to_leave_is_the_one_that_clears(etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s, Membership(s, "a", detect_s=0.5, beat_s=0.05) as a, \
            Membership(s, "b", detect_s=0.5, beat_s=0.05) as b:
        t0 = time.monotonic()
        assert not a.leave()  # b still beats and has not left: b goes last
        assert time.monotonic() - t0 < 0.5  # two looks at b's heartbeat, not detect_s
        assert b.leave()  # a left: nothing to wait for
        s.clear(keep={"nodes/closed": "b"})
        time.sleep(0.3)  # six heartbeat periods: a node that left beats no more
        assert s.job_keys() == ["nodes/closed"]
        assert not a.leave() and not b.leave()  # cleared already: nobody clears again


def test_a_lost_node_does_not_keep_the_last_one_from_clearing(
        etcd_server: EtcdCluster) -> None:
    job = job_id()
    with _store(etcd_server, job) as s, Membership(s, "a", detect_s=0.5, beat_s=0.05) as a:
        Membership(s, "lost", detect_s=0.5, beat_s=0.05).close()  # registered, then silent
        t0 = time.monotonic()
        assert a.leave()  # the lost node's silence seen for detect_s: a is the last
        assert 0.5 <= time.monotonic() - t0 < 2.0
