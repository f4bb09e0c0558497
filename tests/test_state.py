"""The per-rank blob's packing of small tensors: exact round trip for every dtype and
shape, and blobs written before packing still load."""

from __future__ import annotations

import io

import torch

from tierckpt.state import TrainState, _pack, _unpack


def test_small_tensors_round_trip_exactly() -> None:
    src = {("model", "b"): torch.randn(7), ("optim", "state", 0, "step"): torch.tensor(3.0),
           ("x",): torch.tensor([True, False, True]), ("y",): torch.arange(5, dtype=torch.int64),
           ("z",): torch.randn(2, 3, dtype=torch.float64).t(), ("e",): torch.empty(0, 4),
           ("h",): torch.randn(3).half(), ("c",): torch.randn(2, dtype=torch.complex128)}
    out = _unpack(_pack(src))
    assert out.keys() == src.keys()
    for k, v in src.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v)
        assert out[k].untyped_storage().nbytes() == v.numel() * v.element_size()  # owns it


def test_a_blob_from_before_packing_still_loads() -> None:
    old = {"small": {("model", "b"): torch.ones(3), ("optim", "param_groups"): [{"lr": 0.1}]},
           "step": 4, "rank": 0, "world_size": 1, "rng": None, "scheduler": None,
           "dataloader": None, "extra": None}
    buf = io.BytesIO()
    torch.save(old, buf)
    payload = TrainState._decode_blob(torch.frombuffer(bytearray(buf.getvalue()),
                                                       dtype=torch.uint8))
    assert torch.equal(payload["small"][("model", "b")], torch.ones(3))
    assert payload["small"][("optim", "param_groups")] == [{"lr": 0.1}]


def _blob(payload: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


_BASE = {"small": {}, "step": 4, "rank": 0, "world_size": 1, "rng": None, "scheduler": None,
         "dataloader": None, "extra": None}


def test_the_index_is_plain_bytes_and_an_older_list_index_still_loads() -> None:
    packed = _pack({("model", "b"): torch.arange(3.0), ("s",): torch.tensor(7)})
    assert isinstance(packed["index"], bytes)  # one object for torch.save's pickler
    old_index = [(("model", "b"), torch.float32, (3,), 0)]  # the list format before it
    payload = TrainState._decode_blob(_blob({**_BASE, "small_tensors": {
        "data": torch.arange(3.0).view(torch.uint8), "index": old_index}}))
    assert torch.equal(payload["small"][("model", "b")], torch.arange(3.0))


def test_an_index_naming_a_global_is_refused() -> None:
    import collections
    import pickle

    import pytest

    from tierckpt.errors import CheckpointError

    index = pickle.dumps([(("a",), collections.OrderedDict, (1,), 0)])
    with pytest.raises(CheckpointError, match="only tuples, lists, strings and numbers"):
        TrainState._decode_blob(_blob({**_BASE, "small_tensors": {
            "data": torch.zeros(4, dtype=torch.uint8), "index": index}}))
