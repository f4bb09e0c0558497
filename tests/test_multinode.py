"""Two simulated nodes on one machine, each with its own tier-1 root, and a file:// tier 2.

``torchrun --nnodes 2 --node-rank i`` (static rendezvous on loopback) runs one rank per
node. Each node's uploader uploads its own files; restores on the same nodes read only
local data; a wiped (replaced) node gets exactly its missing files from tier 2; with every
tier-1 root gone the job restores from tier 2 alone — and every resume continues with the
same losses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._launch import WORKLOADS, read_jsonl
from tierckpt._ports import free_port
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.ops.check import check_tier2
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage
from tierckpt.tier2.uploader import Uploader, UploaderConfig

TRAIN = WORKLOADS / "fsdp_train.py"


def _two_nodes(tier1_pattern: str, losses: Path, tier2: str, steps: int) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={i}",
         "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
         str(TRAIN), "--tier1", tier1_pattern, "--losses", str(losses), "--steps", str(steps),
         "--tier2", tier2, "--upload-every", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-6000:]


def _restore_events(root: Path) -> list[dict]:
    return [e for e in read_jsonl(root / layout.EVENTS) if e["event"] == "restore_done"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    base = tmp_path_factory.mktemp("multinode")
    (base / "tier2").mkdir()  # a file:// tier 2 must exist (it is never created)
    tier2 = f"file://{base / 'tier2'}"
    _two_nodes(str(base / "node{node}"), base / "losses.jsonl", tier2, steps=12)
    for node in (0, 1):  # finish what the background uploaders had not yet copied
        with Uploader(UploaderConfig(tier1=base / f"node{node}", tier2=tier2)) as up:
            assert all(r.status in ("verified", "files_verified") for r in up.drain())
    return base, tier2


def _copy_nodes(trained: tuple[Path, str], dest: Path) -> None:
    for node in (0, 1):
        shutil.copytree(trained[0] / f"node{node}", dest / f"node{node}")


@pytest.mark.slow
def test_each_node_holds_only_its_files_and_tier2_has_all(trained: tuple[Path, str]) -> None:
    base, _ = trained
    m0 = mf.Manifest.from_bytes((base / "node0/step-00000011/manifest.json").read_bytes())
    assert m0.domains == ((0,), (1,))
    assert sorted(p.name for p in (base / "node0/step-00000011").glob("*.distcp")) == \
        ["__0_0.distcp"]
    assert sorted(p.name for p in (base / "node1/step-00000011").glob("*.distcp")) == \
        ["__1_0.distcp"]
    remote = Tier2Catalog(LocalStorage(base / "tier2"))
    where = remote.resolve(11)  # content-addressed: both nodes' parts merged in one map
    assert where.objmap is not None and where.committed.manifest == m0
    assert {where.key(f.name) for f in m0.files} <= set(remote.content())
    assert check_tier2(remote.storage, 11).ok


def _resume(tmp: Path, tier2: str, name: str) -> list[dict]:
    losses = tmp / f"{name}.jsonl"
    _two_nodes(str(tmp / "node{node}"), losses, tier2, steps=14)
    return [r for r in read_jsonl(losses)]


@pytest.fixture(scope="module")
def resumed_same(trained: tuple[Path, str],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The trained nodes (a copy) resumed on the same nodes to step 13: its directory and
    its loss rows. Its losses are the reference the other resumes (a replaced node, tier 2
    alone) must reproduce."""
    tmp = tmp_path_factory.mktemp("same")
    _copy_nodes(trained, tmp)
    return tmp, _resume(tmp, trained[1], "same")


@pytest.mark.slow
def test_same_nodes_read_only_local_data(resumed_same: tuple[Path, list[dict]]) -> None:
    tmp_path, rows = resumed_same
    assert [r["step"] for r in rows] == [12, 13]
    for node in (0, 1):
        (ev,) = _restore_events(tmp_path / f"node{node}")[-1:]
        assert ev["step"] == 11 and ev["source"] == "tier1"
        assert ev["bytes_by_source"]["tier2"] == 0 and ev["bytes_by_source"]["tier1"] > 0


@pytest.mark.slow
def test_replaced_node_fetches_exactly_its_files(
        trained: tuple[Path, str], tmp_path: Path,
        resumed_same: tuple[Path, list[dict]]) -> None:
    _copy_nodes(trained, tmp_path)
    shutil.rmtree(tmp_path / "node1")
    same = _resume(tmp_path, trained[1], "replaced")
    m = mf.Manifest.from_bytes((trained[0] / "node1/step-00000011/manifest.json").read_bytes())
    node1_bytes = sum(f.size for f in m.files_for_ranks([1]))
    ev0 = _restore_events(tmp_path / "node0")[-1]
    ev1 = _restore_events(tmp_path / "node1")[-1]
    assert ev0["bytes_by_source"]["tier2"] == 0
    assert ev1["bytes_by_source"]["tier2"] == node1_bytes and ev1["source"] == "tier1+tier2"
    _, reference = resumed_same
    assert [r["loss"] for r in same] == [r["loss"] for r in reference]


@pytest.mark.slow
def test_restore_from_tier2_only(trained: tuple[Path, str], tmp_path: Path,
                                 resumed_same: tuple[Path, list[dict]]) -> None:
    rows = _resume(tmp_path, trained[1], "tier2only")
    for node in (0, 1):
        ev = _restore_events(tmp_path / f"node{node}")[-1]
        assert ev["step"] == 11 and ev["source"] == "tier2"
        assert ev["bytes_by_source"]["tier2"] > 0 and ev["seconds"] > 0
    chosen = [e for node in (0, 1) for e in read_jsonl(tmp_path / f"node{node}" / layout.EVENTS)
              if e["event"] == "checkpoint_chosen"]
    assert len(chosen) == 2 and sum(e["tier2_lists"] for e in chosen) == 1, chosen  # per job
    _, reference = resumed_same
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference]


@pytest.mark.slow
def test_step_committed_on_one_node_only_is_set_aside(trained: tuple[Path, str],
                                                      tmp_path: Path) -> None:
    """A commit that reached node 0 but not node 1 (a rank killed in the commit window):
    the nodes agree on step 7, node 0 moves its stale step 11 aside, and the run commits
    step 11 again instead of crashing at that save on every restart."""
    base, _ = trained
    _copy_nodes(trained, tmp_path)
    shutil.rmtree(tmp_path / "node1" / layout.step_dirname(11))
    empty = tmp_path / "tier2-empty"  # tier 2 does not have step 11 either
    empty.mkdir()
    _two_nodes(str(tmp_path / "node{node}"), tmp_path / "partial.jsonl", f"file://{empty}",
               steps=12)  # the trained run's length: same LR schedule, same losses
    rows = read_jsonl(tmp_path / "partial.jsonl")
    assert [r["step"] for r in rows] == list(range(8, 12))
    full = {r["step"]: r["loss"] for r in read_jsonl(base / "losses.jsonl")}
    assert [r["loss"] for r in rows] == [full[s] for s in range(8, 12)]  # bit-identical
    for node in (0, 1):
        assert _restore_events(tmp_path / f"node{node}")[-1]["step"] == 7
        assert (tmp_path / f"node{node}" / layout.step_dirname(11) / layout.COMPLETE).exists()
    (q,) = [p for p in (tmp_path / "node0" / layout.QUARANTINE).iterdir()
            if p.name.startswith(layout.step_dirname(11))]
    assert "newer than the agreed restore point" in (q / "QUARANTINE_REASON").read_text()
