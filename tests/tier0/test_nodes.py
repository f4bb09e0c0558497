"""Tier 0 on two simulated nodes: real torchrun agents (c10d rendezvous on loopback), one
rank per node, each node with its own tier-0 root on tmpfs (/dev/shm) and tier-1 root on
disk, real SIGKILLs. Every resume continues with the losses of the uninterrupted run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._launch import read_jsonl
from tests._references import FSDP_STEPS, FSDP_TRAIN, FsdpReference
from tierckpt._ports import free_port
from tierckpt.drill.launch import agent_argv
from tierckpt.format import layout

TRAIN = FSDP_TRAIN
STEPS = FSDP_STEPS  # saves after steps 3, 7, 11


def run(base: Path, shm: Path, *extra: str, restarts: int = 0, check: bool = True) -> None:
    """Both nodes' agents; ``extra`` goes to the training script."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(TRAIN), "--tier1", str(base / "node{node}" / "t1"),
           "--tier0", str(shm / "node{node}"), "--losses", str(base / "losses.jsonl"),
           "--steps", str(STEPS), *extra]
    procs = [subprocess.Popen(agent_argv(cmd, nproc=1, nnodes=2, node_rank=i,
                                         max_restarts=restarts, port=port, run_id=run_id),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for i in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if check:
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out[-6000:]


def losses(base: Path) -> dict[int, float]:
    """The loss of each step, from the last attempt that reached it."""
    out: dict[int, float] = {}
    for rec in read_jsonl(base / "losses.jsonl"):
        out[rec["step"]] = rec["loss"]
    return out


def restores(base: Path, node: int) -> list[dict]:
    return [e for e in read_jsonl(base / f"node{node}" / "t1" / layout.EVENTS)
            if e["event"] == "restore_done"]


def skipped(base: Path, node: int) -> list[str]:
    return [e["reason"] for e in read_jsonl(base / f"node{node}" / "t1" / layout.EVENTS)
            if e["event"] == "checkpoint_skipped"]


def flip(path: Path, offset: int = 200) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def reference(fsdp_reference: FsdpReference) -> dict[int, float]:
    """The uninterrupted run's losses: the session's 2-rank run (tests/conftest.py), without
    tier 0 — saving to RAM and replicating to the partner must not change a bit of them."""
    got = {r["step"]: r["loss"] for r in read_jsonl(fsdp_reference.losses)}
    assert sorted(got) == list(range(STEPS))
    return got


class KilledRun:
    """The files of a run whose node 0 died, kept to start several tests from: each calls
    :meth:`fresh`. The run's own directories are reused, since a tier-0 root records the
    tier-1 root of the job it belongs to (``job.json``)."""

    def __init__(self, base: Path, shm: Path) -> None:
        self.base, self.shm = base, shm
        self._kept = [(d, d.with_name(d.name + "-kept")) for d in (base, shm)]
        for live, kept in self._kept:
            shutil.copytree(live, kept)

    def fresh(self) -> tuple[Path, Path]:
        """The run's directory and tier-0 roots, as the killed run left them."""
        for live, kept in self._kept:
            shutil.rmtree(live, ignore_errors=True)
            shutil.copytree(kept, live)
        return self.base, self.shm


@pytest.fixture(scope="module")
def node0_killed_at_9(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledRun]:
    """A run whose node 0 rank SIGKILLed itself after step 9, once step 7 was committed, with
    no restart: step 7 is on both nodes' disks and in their RAM, each node's RAM with its
    partner's replica. The tests that replace or damage node 1 start from it."""
    base = tmp_path_factory.mktemp("t0-killed") / "run"
    shm = Path(tempfile.mkdtemp(prefix="tierckpt-killed-", dir="/dev/shm"))
    base.mkdir()
    (shm / "run").mkdir()
    try:
        run(base, shm / "run", "--kill-at", "9", "--kill-rank", "0", "--kill-after-commit",
            check=False)  # dies, no restart
        yield KilledRun(base, shm / "run")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_killed_rank_resumes_from_its_own_ram(tmp_path: Path, shm: Path,
                                                reference: dict[int, float]) -> None:
    run(tmp_path, shm, "--kill-at", "5", "--kill-rank", "1", "--kill-after-commit", restarts=1)
    for node in (0, 1):
        (r,) = restores(tmp_path, node)
        assert r["step"] == 3 and r["source"] == "tier0"
        assert r["bytes_by_source"]["tier0"] > 0
        assert r["bytes_by_source"]["tier1"] == r["bytes_by_source"]["tier2"] == 0
    assert losses(tmp_path) == reference  # bit-identical floats
    assert (shm / "node0" / "peer" / layout.step_dirname(11) / layout.COMPLETE).exists()


@pytest.mark.slow
def test_a_replaced_node_restores_from_its_partners_ram(
        reference: dict[int, float], node0_killed_at_9: KilledRun) -> None:
    base, shm = node0_killed_at_9.fresh()
    shutil.rmtree(shm / "node1")  # node 1 replaced: its RAM and its disk are gone
    shutil.rmtree(base / "node1" / "t1")
    run(base, shm)
    (r0,) = restores(base, 0)
    (r1,) = restores(base, 1)
    assert r0["step"] == r1["step"] == 7
    assert r1["source"] == "tier0+tier0-peer" and r1["bytes_by_source"]["tier0-peer"] > 0
    assert r1["bytes_by_source"]["tier1"] == r1["bytes_by_source"]["tier2"] == 0
    assert r0["bytes_by_source"]["tier0"] > 0
    assert losses(base) == reference


@pytest.mark.slow
def test_damaged_ram_copies_fall_through_to_tier1(
        reference: dict[int, float], node0_killed_at_9: KilledRun) -> None:
    base, shm = node0_killed_at_9.fresh()
    step7 = layout.step_dirname(7)
    flip(shm / "node1" / step7 / "__1_0.distcp")          # node 1's own RAM copy
    flip(shm / "node0" / "peer" / step7 / "__1_0.distcp")  # and its replica on node 0
    run(base, shm)
    (r1,) = restores(base, 1)
    assert r1["step"] == 7 and r1["bytes_by_source"]["tier1"] > 0
    assert r1["bytes_by_source"]["tier0"] == r1["bytes_by_source"]["tier0-peer"] == 0
    reasons = skipped(base, 1)
    assert any("tier 0" in r and "CRC32C" in r for r in reasons), reasons
    reasons0 = skipped(base, 0)
    assert any("replica" in r and "CRC32C" in r for r in reasons0), reasons0
    assert losses(base) == reference


@pytest.mark.slow
def test_a_ram_only_step_newer_than_tier1_is_the_one_resumed(tmp_path: Path, shm: Path,
                                                             reference: dict[int, float]
                                                             ) -> None:
    # tier 1 every 2nd save: steps 3 and 11 reach the disk, step 7 lives in RAM only
    run(tmp_path, shm, "--tier1-every", "2", "--kill-at", "9", "--kill-rank", "1",
        "--kill-after-commit",
        restarts=1)
    for node in (0, 1):
        (r,) = restores(tmp_path, node)
        assert r["step"] == 7 and r["source"] == "tier0"
        t1 = tmp_path / f"node{node}" / "t1"
        assert (t1 / layout.step_dirname(3) / layout.COMPLETE).exists()
        assert (t1 / layout.step_dirname(11) / layout.COMPLETE).exists()
        assert not (t1 / layout.step_dirname(7)).exists()
    assert losses(tmp_path) == reference
