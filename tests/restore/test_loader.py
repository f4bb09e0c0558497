"""``restore/loader.py``: on the saved layout each rank plans its reads from its own
``__<rank>.metadata`` (so the metadata it reads does not grow with the number of ranks),
checked against the manifest first; a damaged one falls back to ``.metadata`` with a
reason; a state it does not cover (a replicated tensor another rank wrote) takes
``.metadata`` quietly; a new world size reshards through ``.metadata`` as before. Every
checkpoint stays readable by plain ``dcp.load``, with or without the global file."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import tierckpt
from bench.reads import Reads
from tests._launch import spawn
from tierckpt._ports import free_port
from tierckpt.errors import IntegrityError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.restore.loader import load_into, uncovered
from tierckpt.restore.metadata import read_metadata_file
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm


def _state(seed: int) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return tierckpt.TrainState(model=model, optimizer=opt, extra={"seed": seed})


def _flat(st: tierckpt.TrainState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in st.model.state_dict().items()}
    assert st.optimizer is not None
    for i, s in st.optimizer.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _same(a: tierckpt.TrainState, b: tierckpt.TrainState) -> bool:
    fa, fb = _flat(a), _flat(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def _saved(root: Path) -> tuple[tierckpt.TrainState, Path]:
    st = _state(1)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(5, st).wait(60)
    return st, root / layout.step_dirname(5)


def test_each_rank_writes_its_own_metadata_in_dcps_rank_local_form(tmp_path: Path) -> None:
    _, d = _saved(tmp_path / "t1")
    own = layout.rank_metadata_filename(0)
    m = mf.Manifest.from_bytes((d / layout.MANIFEST).read_bytes())
    entry = m.file(own)
    assert entry.rank == 0 and entry.chunks == ()  # read whole, checked whole
    assert (d / own).stat().st_size == entry.size
    mine = FileSystemReader(str(d)).read_metadata(rank=0)  # torch's own reader, by name
    whole = FileSystemReader(str(d)).read_metadata()
    assert mine.state_dict_metadata.keys() == whole.state_dict_metadata.keys()
    assert mine.storage_data == whole.storage_data  # one rank: it wrote everything
    # plain dcp.load with only the rank-local file (DCP falls back to it by itself)
    alone = tmp_path / "alone"
    shutil.copytree(d, alone)
    (alone / layout.METADATA).unlink()
    target = {"model": {k: torch.zeros_like(v) for k, v in _state(2).model.state_dict().items()}}
    dcp.load(target, storage_reader=FileSystemReader(str(alone)), no_dist=True)
    want = _state(1).model.state_dict()
    assert all(torch.equal(target["model"][k], want[k]) for k in want)


def test_a_restore_on_the_saved_layout_never_opens_the_global_metadata(tmp_path: Path) -> None:
    saved, d = _saved(tmp_path / "t1")
    st = _state(7)
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1") as ck, Reads(d) as reads:
        info = ck.restore(st)
    assert info is not None and info.step == 5 and _same(st, saved)
    opened = {name for name, _ in reads.files}
    assert layout.rank_metadata_filename(0) in opened and layout.METADATA not in opened
    # its own file is read whole and checked whole: the per-record CRC32Cs stay unread
    assert layout.rank_records_filename(0) not in opened
    assert st.extra == {"seed": 1}


def test_a_damaged_rank_metadata_falls_back_to_the_global_one_with_a_reason(
        tmp_path: Path) -> None:
    saved, d = _saved(tmp_path / "t1")
    own = d / layout.rank_metadata_filename(0)
    data = bytearray(own.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only its CRC32C tells
    own.write_bytes(bytes(data))
    st = _state(7)
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1") as ck, Reads(d) as reads:
        info = ck.restore(st)
    assert info is not None and info.step == 5 and _same(st, saved)  # the same step, whole
    assert layout.METADATA in {name for name, _ in reads.files}
    (ev,) = [e for e in events.read_events(tmp_path / "t1" / layout.EVENTS)
             if e["event"] == events.METADATA_FALLBACK]
    assert ev["step"] == 5 and "__0.metadata is damaged" in ev["reason"]
    assert "CRC32C" in ev["reason"]
    assert not (tmp_path / "t1" / layout.QUARANTINE).exists()  # nothing was set aside


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a digest tells
    path.write_bytes(bytes(data))


def test_the_loader_takes_its_entries_from_its_part_not_the_manifest(tmp_path: Path) -> None:
    """``load_into`` on the saved layout reads the marker and the rank's manifest part: a
    garbled ``manifest.json`` does not reach it (the chooser, which verifies the whole
    checkpoint, reads that one). A garbled part falls back to the whole manifest, noted."""
    saved, d = _saved(tmp_path / "t1")
    assert layout.part_filename(0) == "manifest.00000.json"
    part = mf.Manifest.from_bytes((d / layout.MANIFEST).read_bytes()).file(
        layout.part_filename(0))
    assert part.rank is None and (d / layout.part_filename(0)).stat().st_size == part.size
    _garble(d / layout.MANIFEST)
    st, notes = _state(7), []
    with Reads(d) as reads:
        load_into(st, d, 1, Comm(), notes=notes)
    assert _same(st, saved) and notes == []
    opened = {name for name, _ in reads.files}
    assert layout.part_filename(0) in opened and layout.MANIFEST not in opened
    # a garbled part: the whole manifest is read instead (here garbled too: refused)
    _garble(d / layout.part_filename(0))
    with pytest.raises(IntegrityError, match="manifest"):
        load_into(_state(8), d, 1, Comm(), notes=notes)
    assert notes and "manifest.00000.json: COMPLETE marker digest does not match" in notes[0]


def test_a_garbled_part_is_not_a_lost_checkpoint(tmp_path: Path) -> None:
    saved, d = _saved(tmp_path / "t1")
    _garble(d / layout.part_filename(0))
    st = _state(7)
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1") as ck:
        info = ck.restore(st)
    assert info is not None and info.step == 5 and _same(st, saved)
    (ev,) = [e for e in events.read_events(tmp_path / "t1" / layout.EVENTS)
             if e["event"] == events.METADATA_FALLBACK]
    assert "manifest.00000.json" in ev["reason"] and "whole manifest.json" in ev["reason"]
    assert not (tmp_path / "t1" / layout.QUARANTINE).exists()


def test_a_checkpoint_from_before_the_parts_loads_through_the_manifest(tmp_path: Path) -> None:
    saved, d = _saved(tmp_path / "t1")
    m = mf.Manifest.from_bytes((d / layout.MANIFEST).read_bytes())
    for f in m.files:
        if layout.is_part(f.name):
            (d / f.name).unlink()
    old = dataclasses.replace(m, files=tuple(f for f in m.files if not layout.is_part(f.name)))
    mbytes = old.to_bytes()
    (d / layout.MANIFEST).write_bytes(mbytes)
    (d / layout.COMPLETE).write_bytes(mf.marker_bytes(mbytes, m.step, m.save_id))
    st, notes = _state(7), []
    with Reads(d) as reads:
        load_into(st, d, 1, Comm(), notes=notes)
    assert _same(st, saved) and notes == []  # nothing to fall back from: no part promised
    assert layout.MANIFEST in {name for name, _ in reads.files}


def test_uncovered_names_what_a_rank_file_cannot_plan(tmp_path: Path) -> None:
    _, d = _saved(tmp_path / "t1")
    md = read_metadata_file(d / layout.rank_metadata_filename(0), load_id=None)
    target = {"model": {k: torch.empty_like(v) for k, v in _state(2).model.state_dict().items()}}
    assert uncovered(target, md) is None
    key = next(k for k in md.storage_data if k.fqn == "model.0.weight")
    del md.storage_data[key]  # as if another rank had written it (a replicated tensor)
    assert uncovered(target, md) == "model.0.weight: chunk at (0, 0) written by another rank"
    target["model"]["0.weight"] = torch.empty(16, 17)
    assert uncovered(target, md) == "model.0.weight: not in this rank's metadata with this shape"


def _dist_worker(rank: int, world: int, port: int, root: str, out: str, kind: str) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def build(seed: int) -> tierckpt.TrainState:
        torch.manual_seed(seed)
        # the first weight is over SMALL_BYTES, so DDP hands it to DCP (smaller plain
        # tensors ride in every rank's blob)
        model = nn.Sequential(nn.Linear(128, 160), nn.Linear(160, 4))
        if kind == "fsdp2":
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            wrapped: nn.Module = model
        else:
            wrapped = DistributedDataParallel(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        torch.manual_seed(seed * 10 + rank)
        wrapped(torch.randn(2, 128)).sum().backward()
        opt.step()
        return tierckpt.TrainState(model=wrapped, optimizer=opt)

    saved = build(1)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(3, saved).wait(60)
    d = Path(root) / layout.step_dirname(3)
    st = build(2)
    with tierckpt.CheckpointManager(tier1=root) as ck, Reads(d) as reads:
        info = ck.restore(st)
    assert info is not None and info.step == 3
    fa, _ = flatten_state_dict(saved.tensors())
    fb, _ = flatten_state_dict(st.tensors())

    def equal(a: object, b: object) -> bool:
        if isinstance(a, DTensor) and isinstance(b, DTensor):
            a, b = a.to_local(), b.to_local()
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return torch.equal(a, b)
        return a == b
    same = fa.keys() == fb.keys() and all(equal(fa[k], fb[k]) for k in fa)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "same": same, "opened": sorted({name for name, _ in reads.files})}))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_ranks_plan_from_their_own_files_when_those_cover_their_shards(
        tmp_path: Path, kind: str) -> None:
    """FSDP2 at world 2: each rank opens its own ``__<rank>.metadata``, never another rank's
    nor ``.metadata``. DDP: the replicated tensors were written by one rank each (DCP's
    de-duplication), so the rank files do not cover them and ``.metadata`` plans the reads
    — quietly (no fallback event: nothing is damaged). Both restore exactly."""
    root = tmp_path / "t1"
    spawn(_dist_worker, 2, free_port(), str(root), str(tmp_path), kind, nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["same"], (kind, rank)
        metas = [n for n in got["opened"] if n.endswith(layout.METADATA)]
        if kind == "fsdp2":
            assert metas == [layout.rank_metadata_filename(rank)], got
            # the entries of its own files come from its part; no rank opens the whole
            # manifest (the domain's owner verified the checkpoint from its parts too)
            assert layout.part_filename(rank) in got["opened"]
            assert layout.MANIFEST not in got["opened"], got
        else:
            assert layout.METADATA in metas, got
    assert not [e for e in events.read_events(root / layout.EVENTS)
                if e["event"] == events.METADATA_FALLBACK]
