"""Locating a tensor's raw bytes in a torch.save record, against torch's own writer and
zipfile's reading of the same archives (zip64 included)."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from tierckpt.format.torchzip import tensor_data_offset


def _record(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _find(data: bytes, nbytes: int) -> int | None:
    return tensor_data_offset(lambda off, n: data[off:off + n], len(data), nbytes)


@pytest.mark.parametrize("t", [torch.randn(1000), torch.arange(12, dtype=torch.int64),
                               torch.randn(64, 33).half(), torch.randn(3, 4).t().contiguous(),
                               torch.ones(5, dtype=torch.bool)])
def test_the_offset_holds_exactly_the_tensor(t: torch.Tensor) -> None:
    data = _record(t)
    nbytes = t.numel() * t.element_size()
    off = _find(data, nbytes)
    assert off is not None
    raw = torch.frombuffer(bytearray(data[off:off + nbytes]), dtype=t.dtype).view(t.shape)
    assert torch.equal(raw, t)
    with zipfile.ZipFile(io.BytesIO(data)) as z:  # the same bytes zipfile reads as data/0
        (name,) = [n for n in z.namelist() if "/data/" in n]
        assert z.read(name) == data[off:off + nbytes]


@pytest.mark.parametrize("obj, nbytes", [
    (torch.randn(10)[2:5], 12),            # a view: its storage is larger than the tensor
    ({"a": torch.randn(4), "b": torch.randn(4)}, 16),  # two storages
    (torch.randn(4), 15),                  # a size that is not the tensor's
])
def test_records_that_are_not_one_plain_storage_answer_none(obj: object, nbytes: int) -> None:
    assert _find(_record(obj), nbytes) is None


def test_garbage_and_truncated_records_answer_none() -> None:
    data = _record(torch.randn(100))
    assert _find(b"\0" * 500, 400) is None
    assert _find(data[: len(data) // 2], 400) is None
    assert _find(data[:-10], 400) is None  # the end record cut off


def test_zip64_archives_are_read() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"p" * 100)
        with z.open("archive/data/0", "w", force_zip64=True) as f:
            f.write(b"0123456789" * 8)
    data = buf.getvalue()
    off = _find(data, 80)
    assert off is not None and data[off:off + 80] == b"0123456789" * 8


def test_compressed_storage_answers_none() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"p" * 100)
        z.writestr("archive/data/0", b"\0" * 80)
    assert _find(buf.getvalue(), 80) is None
