"""Domain owners keep the ``.metadata`` they committed: in real gloo runs with two simulated
nodes (one tier-1 root per rank, so both ranks own a domain), a save whose ``.metadata`` is
unchanged sends the other owner the manifest and a digest, not the bytes; every node's
``.metadata`` is still the coordinator's, byte for byte, and plain ``dcp.load`` reads it.
An owner that lost what it held (a new process) gets the bytes again in the same save."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierckpt
from tests._launch import spawn
from tierckpt._ports import free_port
from tierckpt.format import layout
from tierckpt.runtime.commcount import counting

pytestmark = pytest.mark.slow  # spawned gloo ranks

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])


def _worker(rank: int, port: int, base: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    m = _model()
    state = tierckpt.TrainState(model=m)
    received = []
    with tierckpt.CheckpointManager(tier1=Path(base, f"node{rank}"), keep_last=STEPS) as ck:
        assert ck._g.saver.is_owner
        for step in range(STEPS):
            if step == STEPS - 1 and rank == 1:
                ck._g.saver.committer.held = None  # as a new process would hold nothing
            with counting() as c:
                ck.save(step, state).wait()
            received.append(c.to_json()["received"])
    Path(base, f"rank{rank}.json").write_text(json.dumps({"received": received}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("owners")
    spawn(_worker, free_port(), str(base), nprocs=2)
    return base, [json.loads((base / f"rank{r}.json").read_text()) for r in (0, 1)]


def _metadata(base: Path, node: int, step: int) -> bytes:
    return (base / f"node{node}" / layout.step_dirname(step) / layout.METADATA).read_bytes()


def test_an_owner_that_holds_the_metadata_is_sent_its_digest(
        run: tuple[Path, list[dict[str, Any]]]) -> None:
    base, ranks = run
    size = len(_metadata(base, 0, 0))
    got = ranks[1]["received"]
    # save 0 sends the bytes; saves 1 and 2 (nothing changed) a digest in their place
    assert got[0] > size, (got, size)
    assert max(got[1], got[2]) < got[0] - size + 64, (got, size)


def test_an_owner_that_lost_it_gets_the_bytes_again(
        run: tuple[Path, list[dict[str, Any]]]) -> None:
    base, ranks = run
    got = ranks[1]["received"]
    assert got[-1] > got[1] + len(_metadata(base, 0, 0)) - 64, got


def test_every_node_holds_the_coordinators_metadata(
        run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    base, _ = run
    for step in range(STEPS):
        assert _metadata(base, 1, step) == _metadata(base, 0, step), step
    want = _model().state_dict()
    for node in (0, 1):  # plain DCP reads a checkpoint committed from a digest: this
        # node's .metadata with both nodes' shard files (each node holds its own)
        merged = tmp_path / f"merged{node}"
        shutil.copytree(base / f"node{node}" / layout.step_dirname(2), merged)
        other = base / f"node{1 - node}" / layout.step_dirname(2)
        for f in other.glob("*.distcp"):
            shutil.copy(f, merged / f.name)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load({"model": got}, checkpoint_id=str(merged), no_dist=True)
        assert all(torch.equal(got[k], want[k]) for k in want)
