"""The save protocol without per-save replanning and without O(W) traffic to every rank:
counted in real gloo runs at W = 2 and 4 (FSDP2), the collectives of a save do not grow with
W, a non-coordinator rank receives the same bytes at both, the plan is built once while the
layout stays, a changed layout is replanned, and plain ``dcp.load`` reads every checkpoint
bit for bit. A restore runs no central plan."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

import tierckpt
from tests._launch import spawn
from tierckpt._ports import free_port
from tierckpt.format import layout
from tierckpt.runtime.commcount import counting

pytestmark = pytest.mark.slow  # spawned gloo ranks at two world sizes


def _model(width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    return m


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = tierckpt.TrainState(model=m, optimizer=opt)
    result: dict[str, Any] = {}
    with tierckpt.CheckpointManager(tier1=root) as ck:
        saver = ck._g.saver
        for step in range(3):
            with counting() as c:
                ck.save(step, state).wait()
            result[f"save{step}"] = c.to_json()
        result["plans"] = saver._plans.plans
        result["reused"] = saver._plans.reused
    metas = [(Path(root) / layout.step_dirname(s) / layout.METADATA).read_bytes()
             for s in (1, 2)]
    result["metadata_same"] = metas[0] == metas[1]
    with tierckpt.CheckpointManager(tier1=root) as ck, counting() as c:
        ck.restore(state)
    result["restore"] = c.to_json()
    # plain DCP reads the newest checkpoint (a cached-plan save) into a fresh model
    fresh = _model()
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=str(Path(root) / layout.step_dirname(2)))
    a = {k: v.full_tensor() for k, v in m.state_dict().items()}
    b = {k: v.full_tensor() for k, v in sd["model"].items()}
    result["dcp_load_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    Path(out, f"{world}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("counts")
    got = {}
    for world in (2, 4):
        root = tmp_path_factory.mktemp(f"w{world}")
        spawn(_worker, world, free_port(), str(root), str(out), nprocs=world)
        got[world] = [json.loads((out / f"{world}-{r}.json").read_text())
                      for r in range(world)]
    return got


def test_the_plan_is_built_once_while_the_layout_stays(runs: dict[int, list[dict]]) -> None:
    for ranks in runs.values():
        assert all(r["plans"] == 1 for r in ranks)
        first, later = ranks[1]["save0"], ranks[1]["save1"]
        assert first["by_kind"].get("scatter_object_list") == 1
        assert "scatter_object_list" not in later["by_kind"]
        assert later["collectives"] < first["collectives"]


def test_an_unchanged_layout_rewrites_the_same_metadata(runs: dict[int, list[dict]]) -> None:
    """Saves 1 and 2 (same plan, same records): every rank sends a digest, not its write
    results, and the coordinator writes the previous ``.metadata`` bytes again (plain
    ``dcp.load`` still reads them: the last test)."""
    for ranks in runs.values():
        assert ranks[0]["reused"] == 2 and ranks[0]["metadata_same"]
        first, later = ranks[0]["save0"]["received"], ranks[0]["save2"]["received"]
        assert later < first, (first, later)


def test_collectives_per_save_and_restore_do_not_grow_with_w(
        runs: dict[int, list[dict]]) -> None:
    for what in ("save1", "save2", "restore"):
        counts = {w: {r[what]["collectives"] for r in ranks} for w, ranks in runs.items()}
        assert counts[2] == counts[4] and len(counts[2]) == 1, (what, counts)


def test_a_non_coordinator_receives_the_same_bytes_at_every_w(
        runs: dict[int, list[dict]]) -> None:
    got = {w: max(r["save2"]["received"] for r in ranks[1:]) for w, ranks in runs.items()}
    assert got[2] == got[4], got  # no global metadata or manifest comes back to it
    assert runs[4][0]["save2"]["received"] > runs[2][0]["save2"]["received"]  # coordinator


def test_a_restore_runs_no_central_plan(runs: dict[int, list[dict]]) -> None:
    for ranks in runs.values():
        kinds = ranks[0]["restore"]["by_kind"]
        assert "scatter_object_list" not in kinds, kinds


def test_plain_dcp_reads_a_cached_plan_save(runs: dict[int, list[dict]]) -> None:
    assert all(r["dcp_load_equal"] for ranks in runs.values() for r in ranks)


def test_a_changed_layout_is_replanned(tmp_path: Path) -> None:
    from tierckpt.runtime.topology import Comm
    from tierckpt.save.coordinate import PlanCache, save
    from tierckpt.save.writer import ShardWriter

    cache, comm = PlanCache(), Comm()
    for i, shape in enumerate([(4, 4), (4, 4), (8, 4)]):
        d = tmp_path / f"c{i}"
        d.mkdir()
        w = ShardWriter(d)
        written = save({"w": torch.ones(shape) * i}, w, comm, cache)
        assert written.error is None and written.replanned == (i != 1)
        loaded = {"w": torch.zeros(shape)}
        dcp.load(loaded, checkpoint_id=str(d), no_dist=True)
        assert torch.equal(loaded["w"], torch.ones(shape) * i)
    assert cache.plans == 2 and cache.reused == 1  # the second save: same .metadata


def test_a_digest_the_coordinator_cannot_match_fails_the_save_once(tmp_path: Path) -> None:
    """The coordinator lost the write results a rank's digest stands for: that save fails
    with the reason (never a .metadata from stale results), the saver clears the rank's
    digest on a failed save, and the next save sends in full and succeeds."""
    from tierckpt.runtime.topology import Comm
    from tierckpt.save.coordinate import PlanCache, save
    from tierckpt.save.writer import ShardWriter

    cache, comm = PlanCache(), Comm()

    def one(i: int) -> str | None:
        d = tmp_path / f"c{i}"
        d.mkdir()
        return save({"w": torch.ones(4, 4) * i}, ShardWriter(d), comm, cache).error
    assert one(0) is None
    cache.results.clear()
    err = one(1)
    assert err is not None and "does not hold" in err
    assert not (tmp_path / "c1" / layout.METADATA).exists()
    cache.sent = b""  # what AsyncSaver does after a failed save
    assert one(2) is None and cache.reused == 0
    loaded = {"w": torch.zeros(4, 4)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "c2"), no_dist=True)
    assert torch.equal(loaded["w"], torch.ones(4, 4) * 2)
