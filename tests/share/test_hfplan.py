"""tierckpt.share.hfplan: the plan of an export, on values only (the cast rule, shards and
their names)."""

from __future__ import annotations

import pytest
import torch

from tests.share._hf import PLAN_200, mixed, specs_of
from tierckpt.errors import ConfigError
from tierckpt.share.hfplan import TensorSpec, index_name, output_dtype, plan_shards, shard_names


def test_plan_is_greedy_in_order_and_an_oversized_tensor_gets_its_own_shard() -> None:
    plan = plan_shards(specs_of(mixed()), max_shard_bytes=200, dtype=None)
    assert [[s.name for s in shard] for shard in plan] == PLAN_200
    assert len(plan_shards(specs_of(mixed()), max_shard_bytes=10**9, dtype=None)) == 1
    # sizes are after the cast: at 300 bytes, f32 gives 512 | 128+8+15+0+56 = 207 (+128 > 300)
    # | 128, bf16 halves the f32 tensors: 256 (+128 > 300) | 128+8+15+0+56+64 = 271
    assert [len(s) for s in plan_shards(specs_of(mixed()), max_shard_bytes=300,
                                        dtype=None)] == [1, 5, 1]
    assert [len(s) for s in plan_shards(specs_of(mixed()), max_shard_bytes=300,
                                        dtype=torch.bfloat16)] == [1, 6]


def test_shard_names_follow_save_pretrained() -> None:
    assert shard_names("safetensors", 1) == ["model.safetensors"]
    assert shard_names("safetensors", 3)[0] == "model-00001-of-00003.safetensors"
    assert shard_names("torch", 2) == ["pytorch_model-00001-of-00002.bin",
                                       "pytorch_model-00002-of-00002.bin"]


@pytest.mark.parametrize("specs, limit, match", [
    ([], 100, "empty"),
    ([TensorSpec("a", (1,), torch.float32)] * 2, 100, "duplicate"),
    ([TensorSpec("a", (1,), torch.float32)], 0, "max_shard_bytes"),
])
def test_plan_refuses(specs: list[TensorSpec], limit: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_shards(specs, max_shard_bytes=limit, dtype=None)


def test_the_cast_rule() -> None:
    assert output_dtype(torch.float32, None) is torch.float32
    assert output_dtype(torch.float32, torch.bfloat16) is torch.bfloat16
    assert output_dtype(torch.float16, torch.float32) is torch.float32
    assert output_dtype(torch.int64, torch.bfloat16) is torch.int64
    assert output_dtype(torch.bool, torch.float16) is torch.bool
    for bad in (torch.int32, torch.bool, torch.complex64):
        with pytest.raises(ConfigError, match=r"floating dtype, one of .*bfloat16"):
            output_dtype(torch.float32, bad)


def test_index_names_follow_save_pretrained() -> None:
    assert index_name("safetensors") == "model.safetensors.index.json"
    assert index_name("torch") == "pytorch_model.bin.index.json"
