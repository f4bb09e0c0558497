"""Deleting from content-addressed tier 2 (tier2/sweep.py through the catalogue): a kill at
every point of a deletion leaves every complete step restorable, an upload in flight keeps
what it skipped (its intent, and the lease re-check when a sweep missed the intent), and a
stale lease expires."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from s3server import S3Env

from tests._synthetic import make_checkpoint
from tests.tier2.test_content import BASE, derive
from tierckpt.format import layout, objmap
from tierckpt.ops.check import check_tier2
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2 import probe
from tierckpt.tier2 import sweep as sw
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.fetch import fetch_into_tier1
from tierckpt.tier2.storage import LocalStorage, MemoryStorage, Storage, open_storage
from tierckpt.tier2.storage.runs import RunStorage
from tierckpt.tier2.uploader.transfer import upload_step


class Killed(Exception):
    """The deleting process died here."""


Hook = Callable[[str, str, str], None]


class Wrapped:
    """A storage whose calls run ``hook(op, key_or_prefix, "before"|"after")`` (a fake
    wrapper around a real store, not a mock)."""

    def __init__(self, inner: Storage, hook: Hook) -> None:
        self.inner, self.hook = inner, hook

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in ("put_bytes", "put_file", "head", "list", "delete", "get_bytes"):
            return attr

        def call(key: str = "", *a: Any, **kw: Any) -> Any:
            self.hook(name, key, "before")
            out = attr(key, *a, **kw)
            self.hook(name, key, "after")
            return out
        return call


def _upload(t1: Path, remote: Tier2Catalog, step: int) -> Any:
    return upload_step(Tier1Catalog(t1), remote, step, log=events.EventLog(t1 / layout.EVENTS))


def _four_steps(t1: Path, t2: Path) -> None:
    """Step 0 in the old layout; 1-4 content-addressed, each sharing most bytes."""
    make_checkpoint(t1, 0, BASE)
    st = LocalStorage(t2)
    for name in (*BASE, layout.MANIFEST, layout.COMPLETE):
        st.put_bytes(Tier2Catalog.key(0, name), (t1 / "step-00000000" / name).read_bytes())
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"})
    derive(t1, 2, 3, changed={"__0_1.distcp"})
    derive(t1, 3, 4, changed={"__0_1.distcp", ".metadata"})
    for step in (1, 2, 3, 4):
        assert _upload(t1, Tier2Catalog(st), step).status == "verified"


def _referenced(remote: Tier2Catalog) -> set[str]:
    return {k for s in remote.complete_steps()
            for k in (remote.resolve(s).objmap or objmap.ObjectMap(
                step=s, manifest_sha256="", entries=())).keys().values()}


def test_a_kill_at_every_deletion_point_leaves_every_complete_step_whole(
        tmp_path: Path) -> None:
    t1, pristine = tmp_path / "t1", tmp_path / "t2"
    pristine.mkdir()
    _four_steps(t1, pristine)
    calls: list[str] = []

    def count(op: str, key: str, when: str) -> None:
        if op == "delete" and when == "before":
            calls.append(key)

    probe = tmp_path / "probe"
    shutil.copytree(pristine, probe)
    assert Tier2Catalog(Wrapped(LocalStorage(probe), count)).apply_retention(  # type: ignore[arg-type]
        keep_last=2, keep_every=0) == [0, 1, 2]
    assert any(k.startswith(objmap.OBJECTS) for k in calls) and len(calls) >= 15, calls
    for kill_at in range(len(calls)):
        t2 = tmp_path / f"kill{kill_at}"
        shutil.copytree(pristine, t2)
        seen = [0]

        def die(op: str, key: str, when: str, kill_at: int = kill_at, seen: list = seen) -> None:
            if when == "before" and (seen[0] > kill_at or op == "delete"):
                seen[0] += op == "delete"
                if seen[0] > kill_at:
                    raise Killed(f"killed at delete #{kill_at}: {key}")

        try:
            Tier2Catalog(Wrapped(LocalStorage(t2), die)).apply_retention(  # type: ignore[arg-type]
                keep_last=2, keep_every=0)
        except Killed:
            pass
        else:
            raise AssertionError(f"no kill at delete #{kill_at}")
        remote = Tier2Catalog(LocalStorage(t2))
        steps = remote.complete_steps()
        assert {3, 4} <= set(steps), (kill_at, steps)
        for step in steps:  # every step still complete verifies, every byte
            report = check_tier2(LocalStorage(t2), step)
            assert report.ok, (kill_at, calls[kill_at], report.error)
        remote.apply_retention(keep_last=2, keep_every=0)  # the next pass finishes the job
        remote.sweep()
        assert remote.complete_steps() == [3, 4]
        assert set(remote.content()) == _referenced(remote), kill_at
        shutil.rmtree(t2)


def test_an_upload_in_flight_keeps_what_it_skipped(tmp_path: Path) -> None:
    """Its map part is an intent: a deletion of the step it shares with spares the objects,
    and the upload, resumed, completes."""
    t1 = tmp_path / "t1"
    make_checkpoint(t1, 1, BASE)
    derive(t1, 2 - 1, 2, changed={"__0_1.distcp"})
    st = MemoryStorage()
    remote = Tier2Catalog(st)
    assert _upload(t1, remote, 1).status == "verified"
    shared = {n: remote.resolve(1).key(n) for n in BASE if n != "__0_1.distcp"}
    st.inject("put_file", error=OSError("link down"))  # the adapter of step 2: never sent
    assert _upload(t1, remote, 2).status == "failed"
    remote.delete(1)
    assert remote.complete_steps() == [] and set(shared.values()) <= set(remote.content())
    r = _upload(t1, remote, 2)
    assert r.status == "verified" and r.bytes == BASE["__0_1.distcp"][0]
    assert check_tier2(st, 2).ok


def test_a_sweep_that_missed_the_intent_is_repaired_before_the_marker(tmp_path: Path) -> None:
    """The race: a sweep lists the maps before an upload writes its part, the upload skips
    an object that is there, the sweep then deletes it. The upload waits out the sweep's
    lease, finds the object gone and sends it again before its marker."""
    t1 = tmp_path / "t1"
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"})
    st = MemoryStorage()
    assert _upload(t1, Tier2Catalog(st), 1).status == "verified"
    frozen = Tier2Catalog(st).resolve(1).key("__0_0.distcp")
    listed, skipped = threading.Event(), threading.Event()

    def uploader(op: str, key: str, when: str) -> None:
        if op == "put_bytes" and key.endswith(".r00000.json") and when == "before":
            assert listed.wait(10), "the sweep never listed"
        if op == "head" and key == frozen and when == "after":
            skipped.set()

    def sweeper(op: str, key: str, when: str) -> None:
        if op == "list" and key == "step-" and when == "after":
            listed.set()  # before the upload's part exists
        if op == "delete" and key.startswith(objmap.OBJECTS) and when == "before":
            assert skipped.wait(10), "the upload never skipped"

    done: list[Any] = []
    sweep = threading.Thread(target=lambda: done.append(Tier2Catalog(
        Wrapped(st, sweeper), sweep_window_s=5).delete(1)))  # type: ignore[arg-type]
    sweep.start()
    r = _upload(t1, Tier2Catalog(Wrapped(st, uploader), sweep_window_s=5), 2)  # type: ignore[arg-type]
    sweep.join(10)
    assert done and done[0].deleted >= 3  # the sweep did delete what the upload skipped
    assert r.status == "verified", r
    assert r.bytes == sum(s for s, _ in BASE.values())  # skipped, then sent again
    assert st.head(frozen) is not None and check_tier2(st, 2).ok


def test_a_stale_lease_expires_and_is_removed(tmp_path: Path) -> None:
    st = MemoryStorage()
    st.put_bytes(f"{objmap.SWEEPS}dead.json", b"{}")
    Tier2Catalog(st, sweep_window_s=0.05).await_sweeps()
    assert st.list(objmap.SWEEPS) == []


def test_a_lease_expires_after_twice_the_shorter_of_its_declared_window_and_ours() -> None:
    """A killed sweep that declared a 0.05-s window holds an uploader (window 30 s) back
    about 0.1 s, not 60; one declaring more than the uploader's, or nothing readable, is
    held to the uploader's own window."""
    st = MemoryStorage()
    st.put_bytes(f"{objmap.SWEEPS}short.json", b'{"window_s": 0.05}')
    t0 = time.monotonic()
    Tier2Catalog(st, sweep_window_s=30.0).await_sweeps()
    assert time.monotonic() - t0 < 5.0 and st.list(objmap.SWEEPS) == []
    for body in (b'{"window_s": 3600}', b"not json", b'{"window_s": -1}', b"[]"):
        st.put_bytes(f"{objmap.SWEEPS}odd.json", body)
        t0 = time.monotonic()
        Tier2Catalog(st, sweep_window_s=0.1).await_sweeps()
        assert 0.2 <= time.monotonic() - t0 < 5.0, body
        assert st.list(objmap.SWEEPS) == []


def _siblings(tmp_path: Path, base: Storage) -> tuple[Tier2Catalog, Tier2Catalog, Path]:
    """Runs a and b fine-tuned from one base under one prefix: a uploads steps 1 and 2, b
    (the same base, its own adapters) step 5; b's tier 1 is kept to compare with."""
    ta, tb = tmp_path / "a", tmp_path / "b"
    make_checkpoint(ta, 1, BASE)
    derive(ta, 1, 2, changed={"__0_1.distcp"})
    make_checkpoint(tb, 1, BASE)  # the same base bytes as a's
    derive(tb, 1, 5, changed={"__0_1.distcp", ".metadata"})
    a, b = Tier2Catalog(RunStorage(base, "a")), Tier2Catalog(RunStorage(base, "b"))
    assert [_upload(ta, a, s).status for s in (1, 2)] == ["verified"] * 2
    r = _upload(tb, b, 5)  # a sibling's first upload sends what differs from the base only
    assert r.status == "verified" and r.bytes == BASE["__0_1.distcp"][0] + BASE[".metadata"][0]
    return a, b, tb


def test_sibling_runs_share_the_base_and_never_delete_each_others_objects(
        tmp_path: Path) -> None:
    t2 = tmp_path / "t2"
    t2.mkdir()
    base = LocalStorage(t2)
    a, b, tb = _siblings(tmp_path, base)
    assert a.complete_steps() == [1, 2] and b.complete_steps() == [5]  # each its own steps
    assert Tier2Catalog(base).sweep().deleted == 0  # the prefix's own run keeps theirs too
    a.delete(1)
    result = a.delete(2)  # a is gone from tier 2: its sweep keeps what b's map names
    assert result is not None and result.deleted >= 2 and result.blocked is None
    assert a.complete_steps() == [] and set(b.content()) == _referenced(b)
    assert check_tier2(RunStorage(base, "b"), 5).ok
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    fetch_into_tier1(b, Tier1Catalog(fresh), 5, names=None)  # from tier 2 alone
    for p in (tb / "step-00000005").iterdir():
        assert (fresh / "step-00000005" / p.name).read_bytes() == p.read_bytes(), p.name


def test_a_siblings_upload_in_flight_keeps_what_it_skipped(tmp_path: Path) -> None:
    """b's upload in flight (its map part written, no marker yet) relies on a's objects: a
    deleted from tier 2 (every step, as ``gc`` does) leaves them, by b's intent."""
    t2 = tmp_path / "t2"
    t2.mkdir()
    a, b, _ = _siblings(tmp_path, LocalStorage(t2))
    m = b.resolve(5).objmap
    assert m is not None
    b.write_part(5, m, "r00000")  # step 5 back to an upload in flight: its intent, no marker
    for name in (layout.COMPLETE, objmap.MAP):
        b.storage.delete(Tier2Catalog.key(5, name))
    assert b.complete_steps() == []
    a.delete(1)
    a.delete(2)
    assert set(m.keys().values()) <= set(a.content())


@pytest.mark.slow
def test_sibling_runs_on_the_s3_servers_resume_from_tier2_after_deletions(
        tmp_path: Path, any_s3_env: S3Env) -> None:
    """The sibling rule on SeaweedFS and moto: a's steps deleted one by one (each sweeps),
    b's step still verifies and restores from tier 2 alone, byte for byte."""
    probed = probe.probe_url(f"{any_s3_env.url}?run=b")  # a run's URL probes its server
    assert probed.modes == probe.probe_url(any_s3_env.url).modes
    opts = probed.store_options()  # moto: MD5, as a job's uploader opens it
    with open_storage(any_s3_env.url, **opts) as base:
        a, b, tb = _siblings(tmp_path, base)
        for step in (1, 2):
            a.delete(step)
        assert a.complete_steps() == [] and set(b.content()) == _referenced(b)
        assert check_tier2(RunStorage(base, "b"), 5).ok
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        fetch_into_tier1(b, Tier1Catalog(fresh), 5, names=None)
        for p in (tb / "step-00000005").iterdir():
            assert (fresh / "step-00000005" / p.name).read_bytes() == p.read_bytes(), p.name
        assert any(k.startswith("runs/b/step-00000005/") for k in any_s3_env.keys())  # noqa: SIM118


def _lease_of_a_process_that_exits(tmp: Path, window_s: float, *, wait: bool) -> \
        subprocess.Popen[bytes]:
    """A real process that writes a sweep's lease into the file tier 2 at ``tmp``, as
    :func:`tierckpt.tier2.sweep.sweep` writes it; with ``wait`` it keeps running."""
    code = ("import sys, time; from tierckpt import _holder; "
            "from tierckpt.format import manifest as mf; "
            "from tierckpt.tier2.storage import LocalStorage; "
            f"LocalStorage(sys.argv[1]).put_bytes('{objmap.SWEEPS}x.json', mf.canonical("
            f"{{'window_s': {window_s}, 'holder': _holder.me()}})); print('leased', flush=True)"
            + ("; time.sleep(60)" if wait else ""))
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"leased\n"
    return proc


def test_the_lease_of_a_sweep_killed_on_this_machine_holds_nothing_back(
        tmp_path: Path) -> None:
    """A job's own sweep killed mid-deletion (its process gone): the next uploader removes
    its 30-s lease at once instead of waiting a minute; a lease whose holder still runs is
    waited for."""
    killed = _lease_of_a_process_that_exits(tmp_path, 30.0, wait=True)
    killed.kill()
    killed.wait()
    slept: list[float] = []
    sw.await_sweeps(LocalStorage(tmp_path), window_s=30.0, sleep=slept.append)
    assert slept == [] and LocalStorage(tmp_path).list(objmap.SWEEPS) == []
    running = _lease_of_a_process_that_exits(tmp_path, 0.2, wait=True)
    try:
        t0 = time.monotonic()
        sw.await_sweeps(LocalStorage(tmp_path), window_s=30.0)
        assert time.monotonic() - t0 >= 0.4  # twice its declared window, as before
    finally:
        running.kill()
        running.wait()
