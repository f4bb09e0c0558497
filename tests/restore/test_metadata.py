"""``.metadata`` is unpickled through an allowlist: real DCP metadata (tierckpt's writer,
FSDP2 on two ranks, plain ``dcp.save``) loads exactly as ``pickle.loads`` would; a planted
``__reduce__`` — even with manifest and marker rewritten to vouch for it — is refused, never
run, and ``restore()`` falls back to the next older step."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import tierckpt
from tests._launch import spawn
from tests._payload import REFUSED, Where, plant_metadata_payload
from tierckpt._ports import free_port
from tierckpt.errors import IntegrityError, UnsafeCheckpointError
from tierckpt.format import layout
from tierckpt.restore.metadata import ALLOWED, load_metadata, read_metadata_file
from tierckpt.restore.reader import DirectReader
from tierckpt.restore.verify import verify_checkpoint
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog

WHERE: tuple[Where, ...] = ("top", "storage_data", "planner_data")


def _state(seed: int = 0) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model[2].to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return tierckpt.TrainState(model=model, optimizer=opt, scheduler=sched, extra={"n": seed})


def _save(root: Path, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` (different weights each); returns each step's model state."""
    saved = {}
    with tierckpt.CheckpointManager(tier1=root) as ck:
        for step in steps:
            st = _state(step)
            saved[step] = {k: v.clone() for k, v in st.model.state_dict().items()}
            ck.save(step, st).wait(60)
    return saved


def _globals(data: bytes) -> set[str]:
    seen: set[str] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return seen


def _assert_loads_as_pickle(path: Path) -> None:
    data = path.read_bytes()
    assert load_metadata(data, source=str(path)) == pickle.loads(data)
    assert _globals(data) <= {f"{m}.{n}" for m, n in ALLOWED}


def test_tierckpt_metadata_loads_like_pickle(tmp_path: Path) -> None:
    _save(tmp_path, [1])
    d = tmp_path / layout.step_dirname(1)
    _assert_loads_as_pickle(d / layout.METADATA)
    md = DirectReader(d).read_metadata()  # what restore uses: storage_meta as torch sets it
    assert md.storage_meta is not None and md.storage_meta.load_id is not None
    # DCP's stream extensions record descriptors on _StorageInfo (no zstd here to write one)
    next(iter(md.storage_data.values())).transform_descriptors = ["stream.zstd/1"]
    assert load_metadata(pickle.dumps(md), source="<memory>") == md


def test_plain_dcp_metadata_loads_like_pickle(tmp_path: Path) -> None:
    sd = {"w": torch.randn(3, 3), "i": torch.arange(4), "obj": {"a": [1, 2]}, "s": "x"}
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    _assert_loads_as_pickle(tmp_path / layout.METADATA)
    theirs = FileSystemReader(tmp_path)
    ours = read_metadata_file(tmp_path / layout.METADATA, load_id=theirs.load_id)
    assert ours == theirs.read_metadata()


def _fsdp_worker(rank: int, world: int, port: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(1, tierckpt.TrainState(model=model, optimizer=opt)).wait(60)
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_metadata_loads_like_pickle(tmp_path: Path) -> None:
    spawn(_fsdp_worker, 2, free_port(), str(tmp_path), nprocs=2)
    _assert_loads_as_pickle(tmp_path / layout.step_dirname(1) / layout.METADATA)


@pytest.mark.parametrize("where", WHERE)
def test_planted_payload_is_refused_not_run(tmp_path: Path, where: Where) -> None:
    root, marker = tmp_path / "t1", tmp_path / "FIRED"
    _save(root, [1])
    d = root / layout.step_dirname(1)
    plant_metadata_payload(d, marker, where=where)
    verify_checkpoint(d, step=1, full=True)  # manifest and marker vouch for the payload
    data = (d / layout.METADATA).read_bytes()
    with pytest.raises(UnsafeCheckpointError) as exc:
        load_metadata(data, source=str(d / layout.METADATA))
    assert exc.value.refused == REFUSED and exc.value.source == str(d / layout.METADATA)
    assert REFUSED in str(exc.value) and str(d) in str(exc.value)
    assert "planted" in str(exc.value) and isinstance(exc.value, IntegrityError)
    with pytest.raises(UnsafeCheckpointError):
        DirectReader(d).read_metadata()
    assert not marker.exists()
    pickle.loads(data)  # the payload is armed: plain unpickling runs it
    assert marker.exists()


@pytest.mark.parametrize("where", ["top", "planner_data"])
@pytest.mark.parametrize("member", ["rank", "global"])
def test_restore_skips_a_planted_checkpoint(tmp_path: Path, where: Where, member: str) -> None:
    """A payload in the rank's own metadata (what a same-layout restore plans from), or in
    ``.metadata`` once the rank file is damaged (the restore falls back to it): refused,
    never run, the step quarantined with the reason."""
    root, marker = tmp_path / "t1", tmp_path / "FIRED"
    saved = _save(root, [1, 2])
    d = root / layout.step_dirname(2)
    if member == "rank":
        plant_metadata_payload(d, marker, where=where, member=layout.rank_metadata_filename(0))
    else:
        plant_metadata_payload(d, marker, where=where)
        own = d / layout.rank_metadata_filename(0)
        own.write_bytes(own.read_bytes()[:-1] + b"!")  # damaged: the restore falls back
    st = _state(99)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        info = ck.restore(st)
    assert not marker.exists()
    assert info is not None and info.step == 1
    assert all(torch.equal(v, saved[1][k]) for k, v in st.model.state_dict().items())
    (reason,) = [r for s, r in info.skipped if s == 2]
    assert REFUSED in reason
    (q,) = Tier1Catalog(root).quarantined()
    assert q.reason is not None and REFUSED in q.reason
    skipped = [e for e in events.read_events(root / layout.EVENTS)
               if e["event"] == events.CHECKPOINT_SKIPPED]
    assert [e["step"] for e in skipped] == [2] and REFUSED in skipped[0]["reason"]


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = tmp_path_factory.mktemp("real")
    _save(root, [1])
    return (root / layout.step_dirname(1) / layout.METADATA).read_bytes()


def _bad_layout(real: bytes) -> bytes:
    data = pickle.dumps([torch.strided])
    assert b"torch.strided" in data
    return data.replace(b"torch.strided", b"torch.nothing")


@pytest.mark.parametrize("make", [
    lambda real: b"",
    lambda real: b"not a pickle at all",
    lambda real: real[: len(real) // 2],
    lambda real: pickle.dumps({"state_dict_metadata": {}}),
    lambda real: pickle.dumps(torch.Size([1, 2])),
    _bad_layout,
], ids=["empty", "garbage", "truncated", "dict", "size", "unknown-layout"])
def test_not_a_metadata_pickle_is_an_integrity_error(real_metadata: bytes,
                                                     make: object) -> None:
    real = real_metadata
    with pytest.raises(IntegrityError) as exc:
        load_metadata(make(real), source="s3://bucket/step/.metadata")  # type: ignore[operator]
    assert not isinstance(exc.value, UnsafeCheckpointError)
    assert "s3://bucket/step/.metadata" in str(exc.value)
