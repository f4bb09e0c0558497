"""DirectReader: tensors land in place (no torch.load + copy) and match DCP's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import tierckpt
from tierckpt.restore.reader import DirectReader, directory_chunks


class _Holder(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 33).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(7).to(dtype))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_in_place_matches_dcp_reader(tmp_path: Path, dtype: torch.dtype) -> None:
    src = _Holder(dtype)
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        ck.save(0, tierckpt.TrainState(model=src)).wait()
    ckpt = tmp_path / "step-00000000"
    direct, plain = _Holder(dtype).state_dict(), _Holder(dtype).state_dict()
    r = DirectReader(ckpt)
    dcp.load({"model": direct}, storage_reader=r)
    dcp.load({"model": plain}, storage_reader=FileSystemReader(ckpt))
    assert r.direct_items == 3 and r.bytes_read > 0
    for k, v in src.state_dict().items():
        assert torch.equal(direct[k], v) and torch.equal(plain[k], v), k


def test_foreign_checkpoint_takes_dcp_path(tmp_path: Path) -> None:
    # Plain dcp.save of a transposed tensor: same storage size, different element order.
    # Without a tierckpt manifest the reader must not trust the raw bytes.
    a = torch.arange(16.0).reshape(4, 4)
    dcp.save({"t": a.T, "v": torch.arange(100.0)[10:20]}, checkpoint_id=str(tmp_path))
    out = {"t": torch.zeros(4, 4), "v": torch.zeros(10)}
    r = DirectReader(tmp_path)
    dcp.load(out, storage_reader=r)
    assert torch.equal(out["t"], a.T) and torch.equal(out["v"], torch.arange(10.0, 20.0))
    assert r.direct_items == 0


def test_direct_false_is_plain_dcp(tmp_path: Path) -> None:
    dcp.save({"x": torch.ones(5)}, checkpoint_id=str(tmp_path))
    out = {"x": torch.zeros(5)}
    r = DirectReader(tmp_path, direct=False)
    dcp.load(out, storage_reader=r)
    assert torch.equal(out["x"], torch.ones(5)) and r.direct_items == 0


def test_a_file_read_in_part_is_checked_record_by_record(tmp_path: Path) -> None:
    # a model-only read of a file that also holds the optimizer (gaps of MiBs): the file
    # cannot be hashed whole from what passed through, so each record is checked alone
    from tests.share._ckpt import flip_byte, record
    from tierckpt.errors import IntegrityError
    from tierckpt.tier1.catalog import read_committed

    model = torch.nn.Linear(512, 1024)  # 2 MiB of weights, 4 MiB of AdamW state
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        ck.save(1, tierckpt.TrainState(model=model, optimizer=opt)).wait(60)
    ckpt = tmp_path / "step-00000001"
    manifest = read_committed(ckpt, step=1).manifest
    entries = {f.name: f for f in manifest.files}

    def load() -> DirectReader:
        sd = {"model": {"weight": torch.zeros(1024, 512), "bias": torch.zeros(1024)}}
        r = DirectReader(ckpt, verify=entries, chunks=directory_chunks(ckpt, manifest))
        dcp.load(sd, storage_reader=r, no_dist=True)
        assert torch.equal(sd["model"]["weight"], model.weight.detach())
        return r

    r = load()
    assert (r.verified_records, r.verified_files, r.unverified_files) == (2, [], [])
    assert r.chunk_index is not None and r.chunk_index.loaded == ["__0.records"]
    path, offset, length = record(tmp_path, 1, "model.weight")
    flip_byte(path, offset + length // 2)
    with pytest.raises(BaseException) as exc:  # DCP wraps it in its CheckpointException
        load()
    failures = getattr(exc.value, "failures", {0: (exc.value, None)})
    (err, _tb), = failures.values()
    assert isinstance(err, IntegrityError) and "record" in str(err) and "CRC32C" in str(err)


def _saved_mlp(root: Path) -> tuple[Path, dict[str, torch.Tensor], dict]:
    from tierckpt.tier1.catalog import read_committed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.Linear(200, 72))
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(1, tierckpt.TrainState(model=model)).wait(60)
    ckpt = root / "step-00000001"
    entries = {f.name: f for f in read_committed(ckpt, step=1).manifest.files}
    return ckpt, {k: v.detach().clone() for k, v in model.state_dict().items()}, entries


@pytest.mark.parametrize("threads", [1, 3])
def test_pieces_split_across_threads_land_and_verify(tmp_path: Path, threads: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 KiB pieces: records span many pieces and the runs cut records in the middle, so a
    # thread starts mid-record and locates the header of a record another thread also reads
    from tierckpt.restore import reader

    monkeypatch.setattr(reader, "_PIECE", 4096)
    ckpt, want, entries = _saved_mlp(tmp_path)
    out = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    r = DirectReader(ckpt, verify=entries, threads=threads)
    dcp.load(out, storage_reader=r, no_dist=True)
    for k, v in want.items():
        assert torch.equal(out["model"][k], v), k
    assert r.direct_items == len(want) and len(r.verified_files) == 1


def test_a_record_that_cannot_be_located_takes_dcp_path(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # a candidate whose zip header is not a plain one-storage record (simulated: the locator
    # says so for one record) is left untouched by the read threads and loaded by DCP's path;
    # the file still verifies whole
    from tierckpt.restore import reader

    ckpt, want, entries = _saved_mlp(tmp_path)
    real = reader._raw_data_offset
    monkeypatch.setattr(reader, "_PIECE", 4096)
    monkeypatch.setattr(reader, "_raw_data_offset", lambda fd, info, n: None
                        if n == 200 * 96 * 4 else real(fd, info, n))
    out = {"model": {k: torch.full_like(v, 7.0) for k, v in want.items()}}
    r = DirectReader(ckpt, verify=entries, threads=2)
    dcp.load(out, storage_reader=r, no_dist=True)
    for k, v in want.items():
        assert torch.equal(out["model"][k], v), k
    assert r.direct_items == len(want) - 1 and len(r.verified_files) == 1
