"""The tier-2 uploader: order, verification, restarts, multi-node markers, retention, and a
real kill -9 of the uploader process mid-upload against SeaweedFS."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from faultproxy import UPLOAD_PART, FaultProxy
from s3server import S3Env

from tests._synthetic import make_checkpoint
from tierckpt.errors import ConfigError, LockError
from tierckpt.format import layout, objmap
from tierckpt.policy import retention
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage, MemoryStorage, ObjectInfo, open_storage
from tierckpt.tier2.uploader import Uploader, UploaderConfig, UploaderProcess
from tierckpt.tier2.uploader.priority import IOPRIO_IDLE, io_priority

MiB = 1024 * 1024


SMALL = {".metadata": (300, None), "__0_0.distcp": (5000, 0), "__0_1.distcp": (7000, 0)}


class Recording(MemoryStorage):
    """A memory store that records the order of puts (a fake, not a mock)."""

    def __init__(self) -> None:
        super().__init__("recording")
        self.puts: list[tuple[str, bool]] = []

    def put_file(self, key: str, path: Any, *, crc32c: int, size: int) -> ObjectInfo:
        info = super().put_file(key, path, crc32c=crc32c, size=size)
        self.puts.append((key, False))
        return info

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        info = super().put_bytes(key, data, if_none_match=if_none_match)
        self.puts.append((key, if_none_match))
        return info


def obj(root: Path, step: int, name: str) -> str:
    """The content key a tier-1 file is uploaded under (layout 2)."""
    return objmap.content_key(hashlib.sha256(
        (root / layout.step_dirname(step) / name).read_bytes()).hexdigest())


def cfg(tier1: Path, **kw: Any) -> UploaderConfig:
    return UploaderConfig(tier1=tier1, tier2=kw.pop("tier2", "memory://x"), **kw)


# -- pure policy -----------------------------------------------------------------------------
def test_tier2_retention_keeps_last_and_every_mth() -> None:
    steps = [10, 20, 30, 40, 50, 60, 70]
    assert retention.tier2_deletions(steps, keep_last=2) == [10, 20, 30, 40, 50]
    assert retention.tier2_deletions(steps, keep_last=2, keep_every=30) == [10, 20, 40, 50]
    assert retention.tier2_deletions(steps, keep_last=1, pinned=[20]) == [10, 30, 40, 50, 60]
    assert retention.tier2_deletions([], keep_last=1) == []
    with pytest.raises(ValueError):
        retention.tier2_deletions(steps, keep_last=0)


def test_next_upload_is_newest_due_and_abandons_older() -> None:
    assert retention.next_upload([1, 2, 3, 4], upload_every=1, done=[]) == 4
    assert retention.next_upload([1, 2, 3, 4], upload_every=2, done=[], marked=[2, 4]) == 4
    assert retention.next_upload([1, 2, 3, 4], upload_every=2, done=[], marked=[2]) == 2
    assert retention.next_upload([2, 4, 6], upload_every=2, done=[4], marked=[2, 6]) == 6
    assert retention.next_upload([2, 4], upload_every=2, done=[4], marked=[2]) is None  # abandoned
    assert retention.next_upload([3, 5], upload_every=2, done=[]) is None  # nothing marked
    assert retention.tier1_upload_holds([2, 4, 6, 8], upload_every=2, done=[4],
                                        marked=[2, 6, 8]) == {6, 8}
    assert retention.tier1_upload_holds([5, 10], upload_every=5, done=[], requested=[5],
                                        marked=[10]) == {5, 10}


def test_upload_cadence_counts_commits_not_step_numbers() -> None:
    # every 5th save with saves at steps 9, 19, ...: the step numbers never matter
    count, marked = 0, []
    for step in range(9, 120, 10):
        count, due = retention.count_commit(count, upload_every=5)
        marked += [step] if due else []
    assert marked == [49, 99]
    assert retention.count_commit(0, upload_every=1) == (0, True)
    with pytest.raises(ValueError, match="upload_every"):
        retention.count_commit(0, upload_every=0)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    for kw in ({"upload_every": 0}, {"keep_last": 0}, {"keep_every": -1}, {"poll_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            cfg(tmp_path, **kw)


# -- in-memory tier 2 ------------------------------------------------------------------------
def test_upload_order_marker_last_and_state(tmp_path: Path) -> None:
    m = make_checkpoint(tmp_path, 10, SMALL)
    store = Recording()
    with Uploader(cfg(tmp_path), storage=store) as up:
        r = up.run_once()
    assert r is not None and (r.step, r.status, r.bytes) == (10, "verified", m.total_bytes)
    keys = [k for k, _ in store.puts]
    part = "step-00000010/objects.r00000.json"
    assert keys[0] == part  # the intent, before any object
    where = Tier2Catalog(store).resolve(10)
    assert sorted(keys[1:4]) == sorted(where.key(n) for n in SMALL)
    assert all(where.key(n).startswith("objects/sha256/") for n in SMALL)
    assert store.puts[4:] == [("step-00000010/objects.json", False),
                              ("step-00000010/manifest.json", False),
                              ("step-00000010/COMPLETE", True)]
    assert store.head(part) is None  # dropped once the marker landed
    for name in SMALL:
        assert store.get_bytes(where.key(name)) == (tmp_path / "step-00000010" /
                                                    name).read_bytes()
    state = Tier1Catalog(tmp_path).uploads.upload_record(10)
    assert state is not None and state["status"] == "verified" and state["save_id"] == "save10"
    assert Tier1Catalog(tmp_path).uploads.uploaded_steps() == {10}
    assert os.listdir(tmp_path / layout.PINS) == []
    kinds = [e["event"] for e in events.read_events(tmp_path / layout.EVENTS)]
    assert kinds == [events.UPLOAD_STARTED, events.UPLOAD_VERIFIED]


def test_failure_mid_upload_leaves_no_marker_then_restart_resumes(tmp_path: Path) -> None:
    m = make_checkpoint(tmp_path, 4, SMALL)
    store = MemoryStorage()
    store.inject("put_file", key_contains=obj(tmp_path, 4, "__0_1.distcp"),
                 error=OSError("disk on fire"))
    with Uploader(cfg(tmp_path), storage=store) as up:
        r = up.run_once()
    assert r is not None and r.status == "failed" and "disk on fire" in (r.error or "")
    assert store.head("step-00000004/COMPLETE") is None
    assert store.head("step-00000004/manifest.json") is None
    assert Tier1Catalog(tmp_path).uploads.upload_record(4)["status"] == "failed"  # type: ignore[index]
    assert os.listdir(tmp_path / layout.PINS) == []
    assert events.UPLOAD_FAILED in [e["event"] for e in
                                    events.read_events(tmp_path / layout.EVENTS)]
    with Uploader(cfg(tmp_path), storage=store) as up:  # the restart
        r = up.run_once()
    assert r is not None and r.status == "verified"
    # Files that were already verified on tier 2 were not sent again.
    assert r.bytes == m.file("__0_1.distcp").size
    assert store.get_bytes("step-00000004/COMPLETE") == (
        tmp_path / "step-00000004" / "COMPLETE").read_bytes()


def test_stored_but_reported_failed_then_verified(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 1, SMALL)
    store = MemoryStorage()
    store.inject("put_bytes", after=True, key_contains="COMPLETE")
    with Uploader(cfg(tmp_path), storage=store) as up:
        assert up.run_once().status == "failed"  # type: ignore[union-attr]
        r = up.run_once()
    assert r is not None and r.status == "verified" and r.bytes == 0


def test_corrupt_tier1_file_is_never_marked(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 2, SMALL)
    p = tmp_path / "step-00000002" / "__0_0.distcp"
    data = bytearray(p.read_bytes())
    data[10] ^= 1
    p.write_bytes(bytes(data))
    store = MemoryStorage()
    with Uploader(cfg(tmp_path), storage=store) as up:
        r = up.run_once()
    assert r is not None and r.status == "failed" and "BadDigest" in (r.error or "")
    assert [i.key for i in store.list() if i.key.endswith(("COMPLETE", "manifest.json"))] == []


def test_a_damaged_manifest_is_uploaded_as_its_marker_vouches(tmp_path: Path) -> None:
    """A ``manifest.json`` damaged on tier 1 beside intact parts: tier 2 gets the manifest
    the parts rebuild (the bytes the marker vouches for) and verifies."""
    m = make_checkpoint(tmp_path, 2, SMALL, domains=((0,),), sealed=True)
    d = tmp_path / "step-00000002"
    intact = (d / layout.MANIFEST).read_bytes()
    (d / layout.MANIFEST).write_bytes(b"{}")
    store = MemoryStorage()
    with Uploader(cfg(tmp_path), storage=store) as up:
        r = up.run_once()
    assert r is not None and r.status == "verified", r
    assert store.get_bytes("step-00000002/manifest.json") == intact
    assert Tier2Catalog(store).read_committed(2).manifest == m
    assert store.get_bytes(Tier2Catalog(store).resolve(2).key(layout.part_filename(0))) == \
        (d / layout.part_filename(0)).read_bytes()


def test_conflicting_remote_checkpoint_is_left_alone(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 3, SMALL)
    store = MemoryStorage()
    store.put_bytes("step-00000003/COMPLETE", b"someone else's marker")
    with Uploader(cfg(tmp_path), storage=store) as up:
        r = up.run_once()
        assert r is not None and r.status == "conflict"
        assert up.run_once() is None  # not retried
    assert [i.key for i in store.list()] == ["step-00000003/COMPLETE"]


def test_every_nth_newest_first_and_tier2_retention(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    local = Tier1Catalog(t1)

    def commit(step: int) -> None:  # as the job does: every 2nd commit is marked
        make_checkpoint(t1, step, {"__0_0.distcp": (100, 0)})
        local.uploads.count_commit(step, upload_every=2)

    for step in range(1, 9):
        commit(step)
    assert local.uploads.upload_marks() == {2, 4, 6, 8}
    config = cfg(t1, tier2=t2.as_uri(), upload_every=2, keep_last=2, keep_every=4)
    with Uploader(config) as up:
        assert isinstance(up.storage, LocalStorage)
        assert [r.step for r in up.drain()] == [8]  # newest due first; 2, 4, 6 abandoned
        for step in (9, 10, 11, 12, 13, 14):
            commit(step)
            assert [r.step for r in up.drain()] == ([step] if step % 2 == 0 else [])
        assert local.uploads.upload_marks() == set()  # done, or abandoned for a newer copy
        # keep last 2 (12, 14) and every 4th forever (8, 12).
        assert Tier2Catalog(up.storage).complete_steps() == [8, 12, 14]
        assert [i.key for i in up.storage.list("step-00000010/")] == []


def test_second_uploader_on_a_root_is_refused(tmp_path: Path) -> None:
    with Uploader(cfg(tmp_path), storage=MemoryStorage()), pytest.raises(LockError):
        Uploader(cfg(tmp_path), storage=MemoryStorage())


def test_two_nodes_marker_after_both(tmp_path: Path) -> None:
    files = {".metadata": (200, None), "__0_0.distcp": (3000, 0), "__1_0.distcp": (4000, 1)}
    domains = ((0,), (1,))
    a, b = tmp_path / "node0", tmp_path / "node1"
    make_checkpoint(a, 5, files, domains=domains, world_size=2, only_ranks={0})
    make_checkpoint(b, 5, files, domains=domains, world_size=2, only_ranks={1})
    store = MemoryStorage()
    with Uploader(cfg(a), storage=store) as up_a:
        assert up_a.run_once().status == "files_verified"  # type: ignore[union-attr]
        assert store.head("step-00000005/COMPLETE") is None
        assert [i.key for i in store.list("step-00000005/")] == [
            "step-00000005/objects.r00000.json"]  # node 0's part: node 1's files missing
        with Uploader(cfg(b), storage=store) as up_b:
            r = up_b.run_once()
        assert r is not None and r.status == "verified"
        assert r.bytes == 4000 + 200 or r.bytes == 4000  # .metadata may already be there
    assert {i.key.split("/")[1] for i in store.list("step-00000005/")} == {
        "objects.json", "manifest.json", "COMPLETE"}
    where = Tier2Catalog(store).resolve(5)
    for name in files:
        node = a if files[name][1] in (None, 0) else b
        assert store.get_bytes(where.key(name)) == (node / "step-00000005" / name).read_bytes()
    assert Tier1Catalog(a).uploads.uploaded_steps() == {5}
    assert Tier1Catalog(b).uploads.uploaded_steps() == {5}


def test_watching_nodes_out_of_phase_complete_steps_while_saves_outpace_their_polls(
        tmp_path: Path) -> None:
    """Two nodes commit a step every 50 ms; their uploaders poll every 0.4 s, node 1's
    started 0.15 s after node 0's. Each looks just after an epoch's start (a wall-clock
    multiple of the poll) and chooses among the steps committed before it, so both upload
    the same steps and tier 2 completes them. (Before, each took the newest step at its own
    moment: each uploaded its part of a different step, and none ever completed.)"""
    files = {".metadata": (200, None), "__0_0.distcp": (3000, 0), "__1_0.distcp": (4000, 1)}
    roots = {tmp_path / "node0": {0}, tmp_path / "node1": {1}}

    def commit(step: int) -> None:
        for root, ranks in roots.items():
            make_checkpoint(root, step, files, domains=((0,), (1,)), world_size=2,
                            only_ranks=ranks)
    commit(0)
    store, stop = MemoryStorage(), threading.Event()
    ups = [Uploader(cfg(r, poll_s=0.4, keep_last=10_000), storage=store) for r in roots]
    threads = []
    for up in ups:
        threads.append(threading.Thread(target=up.watch, args=(stop,)))
        threads[-1].start()
        time.sleep(0.15)
    step, end = 1, time.monotonic() + 4.0
    while time.monotonic() < end:
        commit(step)
        step += 1
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    for up in ups:
        up.close()
    done = Tier2Catalog(store).complete_steps()
    assert len([s for s in done if s > 0]) >= 4, (done, step)  # about one per 0.4 s epoch


def test_a_part_left_by_a_rolled_back_save_of_the_same_step_does_not_block_it(
        tmp_path: Path) -> None:
    """Node 0 uploaded its part of step 5 and was lost before the marker; the job rolled
    back and saved step 5 again (another checkpoint). The stale part, a different
    manifest's, must not fail the new upload (it did: "object map parts of different
    checkpoints", and tier 2 stayed behind for the rest of the run)."""
    files = {".metadata": (200, None), "__0_0.distcp": (3000, 0), "__1_0.distcp": (4000, 1)}
    domains = ((0,), (1,))
    store = MemoryStorage()
    old, a, b = tmp_path / "lost", tmp_path / "node0", tmp_path / "node1"
    make_checkpoint(old, 5, files, domains=domains, world_size=2, only_ranks={0})
    with Uploader(cfg(old), storage=store) as up:
        assert up.run_once().status == "files_verified"  # type: ignore[union-attr]
    for root, ranks in ((a, {0}), (b, {1})):  # step 5 saved again: other bytes, save id
        make_checkpoint(root, 5, files, domains=domains, world_size=2, only_ranks=ranks,
                        seed=99)
    with Uploader(cfg(b), storage=store) as up_b:  # node 1 first: the stale part is there
        assert up_b.run_once().status == "files_verified"  # type: ignore[union-attr]
    with Uploader(cfg(a), storage=store) as up_a:
        r = up_a.run_once()
    assert r is not None and r.status == "verified", r
    where = Tier2Catalog(store).resolve(5)
    for name in files:
        node = a if files[name][1] in (None, 0) else b
        assert store.get_bytes(where.key(name)) == (node / "step-00000005" / name).read_bytes()
    assert {i.key.split("/")[1] for i in store.list("step-00000005/")} == {
        "objects.json", "manifest.json", "COMPLETE"}  # the stale part went with the others


def test_a_step_saved_again_after_a_rollback_is_uploaded_again(tmp_path: Path) -> None:
    """A root whose part of step 5 was uploaded (``files_verified``) before the job rolled
    back and saved step 5 again uploads the new step 5 (its record named the old save)."""
    files = {".metadata": (200, None), "__0_0.distcp": (3000, 0), "__1_0.distcp": (4000, 1)}
    domains = ((0,), (1,))
    store = MemoryStorage()
    a, b = tmp_path / "node0", tmp_path / "node1"
    make_checkpoint(b, 5, files, domains=domains, world_size=2, only_ranks={1})
    with Uploader(cfg(b), storage=store) as up:
        assert up.run_once().status == "files_verified"  # type: ignore[union-attr]
    shutil.rmtree(b / "step-00000005")  # rolled back (quarantined), then saved again
    for root, ranks in ((a, {0}), (b, {1})):
        make_checkpoint(root, 5, files, domains=domains, world_size=2, only_ranks=ranks,
                        seed=99)
    with Uploader(cfg(a), storage=store) as up_a:
        assert up_a.run_once().status == "files_verified"  # type: ignore[union-attr]
    with Uploader(cfg(b), storage=store) as up_b:
        assert up_b.next_step() == 5
        r = up_b.run_once()
    assert r is not None and r.status == "verified", r
    where = Tier2Catalog(store).resolve(5)
    assert store.get_bytes(where.key("__1_0.distcp")) == (b / "step-00000005" /
                                                          "__1_0.distcp").read_bytes()


# -- real S3 and a real kill -9 --------------------------------------------------------------
def _wait_for(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_kill_9_mid_upload_then_restart_finishes(tmp_path: Path, s3_env: S3Env,
                                                 fault_proxy: FaultProxy) -> None:
    sizes = {".metadata": (1000, None), "__0_0.distcp": (6 * MiB + 5, 0)}
    make_checkpoint(tmp_path, 7, sizes)
    opts = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "read_timeout_s": 30.0,
            "integrity": "crc32c"}  # the modes a job passes: no probe (its parts would hang)
    rule = fault_proxy.add_rule("hang", hang_s=120, **UPLOAD_PART)
    config = UploaderConfig(tier1=tmp_path, tier2=s3_env.url, storage_options=opts, poll_s=0.2)
    proc = UploaderProcess(config).start()
    try:
        _wait_for(lambda: rule.fired == 1 or proc.poll() is not None, "a stalled UploadPart")
        assert proc.poll() is None
        pid = proc.pid
        assert pid is not None
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        assert io_priority(pid) in (IOPRIO_IDLE, None)  # None: no ioprio syscall here
        assert (tmp_path / layout.PINS / layout.pin_filename(7, "upload")).exists()
        assert Tier1Catalog(tmp_path).uploads.upload_record(7)["status"] == "uploading"  # type: ignore[index]
        os.kill(pid, signal.SIGKILL)
        proc.stop()
    finally:
        proc.stop()
    shard = obj(tmp_path, 7, "__0_0.distcp")
    assert s3_env.pending_uploads() == [shard]
    assert "step-00000007/COMPLETE" not in s3_env.keys()  # noqa: SIM118

    fault_proxy.clear()
    with Uploader(UploaderConfig(tier1=tmp_path, tier2=s3_env.url, storage_options=opts)) as up:
        assert os.listdir(tmp_path / layout.PINS) == []  # the dead process's pin is gone
        r = up.run_once()
    assert r is not None and r.status == "verified"
    assert s3_env.pending_uploads() == []  # the stale multipart upload was aborted
    assert s3_env.keys() == sorted([obj(tmp_path, 7, ".metadata"), shard,
                                    "step-00000007/COMPLETE", "step-00000007/manifest.json",
                                    "step-00000007/objects.json"])
    st = open_storage(s3_env.url)
    where = Tier2Catalog(st).resolve(7)
    for f in where.committed.manifest.files:
        got = st.get_file(where.key(f.name), tmp_path / "dl" / f.name, crc32c=f.crc32c)
        assert got.size == f.size
        assert (tmp_path / "dl" / f.name).read_bytes() == (
            tmp_path / "step-00000007" / f.name).read_bytes()


@pytest.mark.slow
def test_s3_persistent_failure_is_loud_with_no_marker(tmp_path: Path, s3_env: S3Env,
                                                      fault_proxy: FaultProxy) -> None:
    make_checkpoint(tmp_path, 9, SMALL)
    fault_proxy.add_rule("status", status=503, code="SlowDown", times=None, method="PUT",
                         path=obj(tmp_path, 9, "__0_1.distcp"))
    opts = {"max_attempts": 2, "read_timeout_s": 5.0}
    with Uploader(UploaderConfig(tier1=tmp_path, tier2=s3_env.url, storage_options=opts)) as up:
        r = up.run_once()
    assert r is not None and r.status == "failed" and "SlowDown" in (r.error or "")
    assert not [k for k in s3_env.keys() if  # noqa: SIM118
                 k.endswith(("COMPLETE", "manifest.json"))]
    assert Tier1Catalog(tmp_path).uploads.upload_record(9)["status"] == "failed"  # type: ignore[index]


def test_uploader_process_watches_and_stops_cleanly(tmp_path: Path) -> None:
    t2 = tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    config = UploaderConfig(tier1=tmp_path / "t1", tier2=t2.as_uri(), poll_s=0.1)
    (tmp_path / "t1").mkdir()
    with UploaderProcess(config) as proc:
        make_checkpoint(tmp_path / "t1", 3, SMALL)
        local = Tier1Catalog(tmp_path / "t1")
        _wait_for(lambda: local.uploads.uploaded_steps() == {3} or proc.poll() is not None,
                  "the watcher to upload step 3")
        assert proc.poll() is None
    assert proc.poll() == 0  # SIGTERM → clean exit
    assert Tier2Catalog(LocalStorage(t2)).complete_steps() == [3]
    # finish(): everything due when it is asked is uploaded before the child exits.
    proc = UploaderProcess(config).start()
    make_checkpoint(tmp_path / "t1", 4, SMALL)
    assert proc.finish(timeout_s=120) == 0
    assert Tier2Catalog(LocalStorage(t2)).complete_steps() == [3, 4]



def test_uploads_a_real_checkpoint_manager_checkpoint(tmp_path: Path) -> None:
    import torch
    from torch import nn

    import tierckpt

    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    torch.manual_seed(0)
    model = nn.Linear(32, 8)
    state = tierckpt.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with tierckpt.CheckpointManager(tier1=t1) as ck:
        ck.save(6, state).wait(60)
    with Uploader(UploaderConfig(tier1=t1, tier2=t2.as_uri())) as up:
        [r] = up.drain()
    assert (r.step, r.status) == (6, "verified")
    remote = LocalStorage(t2)
    where = Tier2Catalog(remote).resolve(6)
    m = where.committed.manifest
    assert m.step == 6 and layout.METADATA in {f.name for f in m.files}
    for f in m.files:
        remote.get_file(where.key(f.name), tmp_path / "dl" / f.name, crc32c=f.crc32c)
        assert (tmp_path / "dl" / f.name).read_bytes() == (t1 / "step-00000006" /
                                                         f.name).read_bytes()


def test_uploader_process_exits_when_its_parent_dies(tmp_path: Path) -> None:
    """A SIGKILLed rank must not leave its uploader running (PR_SET_PDEATHSIG/watcher)."""
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tierckpt.tier2.uploader import UploaderConfig, UploaderProcess\n"
        "p = UploaderProcess(UploaderConfig(tier1=Path(sys.argv[1]), tier2=sys.argv[2])).start()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    (tmp_path / "t2").mkdir()  # a file:// tier 2 must exist: opening one never creates it
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t1"),
                               f"file://{tmp_path / 't2'}"], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":  # exited, waiting to be reaped by init
                return
        time.sleep(0.2)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("uploader outlived its parent")


@pytest.mark.slow
def test_a_burst_of_sigterms_never_wedges_the_uploader(tmp_path: Path) -> None:
    """torchrun stops a rank with killpg(SIGTERM), and the rank's death sends its uploader
    another SIGTERM (PDEATHSIG). A handler that set the stop Event itself deadlocked when the
    next signal interrupted it inside ``Event.set`` (the orphan kept its lock for good; the
    chaos drill found it): every uploader must exit, however many SIGTERMs arrive at once."""
    import subprocess
    import sys

    (tmp_path / "t1").mkdir()
    (tmp_path / "t2").mkdir()
    hung = 0
    for _ in range(15):
        ready_r, ready_w = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierckpt.uploader", str(tmp_path / "t1"),
             (tmp_path / "t2").as_uri(), "--watch", "--poll", "0.001", "--ready-fd",
             str(ready_w)], pass_fds=(ready_w,), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(ready_w)
        os.read(ready_r, 1)  # its handlers are installed
        os.close(ready_r)
        for _ in range(300):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            hung += 1
            proc.kill()
            proc.wait()
    assert hung == 0, f"{hung} of 15 uploaders never exited after a burst of SIGTERMs"
