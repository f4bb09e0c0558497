"""tierckpt.share.hfshards: the shard files, through write_hf: the safetensors bytes against
the reference implementation, alignment, the header, the cast, and the memory bound (one
tensor at a time for safetensors, one shard for torch format)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch

from tests.share._hf import (
    PLAN_200,
    assert_bit_equal,
    load_all,
    mixed,
    need_safetensors,
    reader,
    specs_of,
)
from tierckpt.errors import ConfigError
from tierckpt.share.hfplan import TensorSpec
from tierckpt.share.hfshards import safetensors_header
from tierckpt.share.hfwrite import write_hf

try:
    import safetensors.torch as st
    from safetensors import safe_open
except ImportError:  # pragma: no cover - the share extra is missing
    pass


@pytest.mark.parametrize("pad", range(8))
def test_bytes_equal_the_reference_writer(tmp_path: Path, pad: int) -> None:
    """In the reference's own order (dtype, then name) the whole file is byte-identical to
    ``safetensors.torch.save``: header JSON, space padding to a multiple of 8, offsets."""
    need_safetensors()
    g = torch.Generator().manual_seed(pad)
    tensors = {"i" + "x" * pad: torch.randint(0, 9, (3,), generator=g),
               "s": torch.tensor(2.5),
               "w": torch.randn(2, 3, generator=g),
               "h": torch.randn(5, generator=g).to(torch.float16),
               "e": torch.empty(0, 2, dtype=torch.int8),
               "m": torch.tensor([True, False, True])}
    write_hf(tmp_path / "o", specs_of(tensors), reader(tensors))
    ours = (tmp_path / "o" / "model.safetensors").read_bytes()
    assert ours == st.save(tensors, metadata={"format": "pt"})
    n = int.from_bytes(ours[:8], "little")
    assert n % 8 == 0 and ours[8 + n - 1:8 + n] in (b" ", b"}")


def test_every_tensor_is_aligned_whatever_the_given_order(tmp_path: Path) -> None:
    need_safetensors()
    tensors = {"mask": torch.ones(3, dtype=torch.bool), "f": torch.randn(3),
               "h": torch.randn(1).half(), "i": torch.arange(3)}
    write_hf(tmp_path / "o", specs_of(tensors), reader(tensors))
    raw = (tmp_path / "o" / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header.pop("__metadata__") == {"format": "pt"}
    for name, entry in header.items():
        assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name
    loaded, _ = load_all(tmp_path / "o")
    for k, want in tensors.items():
        assert_bit_equal(loaded[k], want, k)


def test_header_is_padded_to_eight_and_metadata_is_kept(tmp_path: Path) -> None:
    need_safetensors()
    specs = [TensorSpec("a", (2,), torch.float32)]
    header = safetensors_header(specs, None, {"k": "v"})
    assert (len(header) - 8) % 8 == 0 and int.from_bytes(header[:8], "little") == len(header) - 8
    out = tmp_path / "o"
    write_hf(out, specs, lambda s: torch.ones(2), metadata={"source": "step-7"})
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "source": "step-7"}
        assert torch.equal(f.get_tensor("a"), torch.ones(2))


def test_cast_to_bfloat16_leaves_integers_and_bools_alone(tmp_path: Path) -> None:
    need_safetensors()
    tensors = mixed()
    res = write_hf(tmp_path / "o", specs_of(tensors), reader(tensors), dtype=torch.bfloat16,
                   max_shard_bytes=200)
    loaded, _ = load_all(tmp_path / "o")
    for k, src in tensors.items():
        want = src.to(torch.bfloat16) if src.is_floating_point() else src
        assert_bit_equal(loaded[k], want, k)
    assert res.tensor_bytes == sum(t.nbytes for t in loaded.values())
    with pytest.raises(ConfigError, match="floating"):
        write_hf(tmp_path / "p", specs_of(tensors), reader(tensors), dtype=torch.int32)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_read_k_happens_after_tensor_k_minus_1_was_freed(tmp_path: Path,
                                                         dtype: torch.dtype | None) -> None:
    """The RAM bound: the writer holds one tensor (and its cast copy), never a shard."""
    tensors = mixed()
    refs: list[weakref.ref[torch.Tensor]] = []

    def read(spec: TensorSpec) -> torch.Tensor:
        if refs:
            assert refs[-1]() is None, f"{spec.name} read while the previous is alive"
        t = tensors[spec.name].clone()
        refs.append(weakref.ref(t))
        return t

    res = write_hf(tmp_path / "o", specs_of(tensors), read, dtype=dtype, max_shard_bytes=10**9)
    assert len(refs) == len(tensors) and refs[-1]() is None
    biggest = max(t.nbytes for t in tensors.values())  # the f32 embedding
    assert res.peak_tensor_bytes == (biggest if dtype is None else biggest * 3 // 2)


def test_torch_format_holds_one_shard_at_a_time(tmp_path: Path) -> None:
    tensors = mixed()
    plan = [set(names) for names in PLAN_200]
    refs: dict[str, weakref.ref[torch.Tensor]] = {}

    def read(spec: TensorSpec) -> torch.Tensor:
        shard = next(i for i, names in enumerate(plan) if spec.name in names)
        if shard and spec.name == PLAN_200[shard][0]:  # first of a shard: the last is gone
            assert all(refs[n]() is None for n in PLAN_200[shard - 1])
        t = tensors[spec.name].clone()
        refs[spec.name] = weakref.ref(t)
        return t

    res = write_hf(tmp_path / "o", specs_of(tensors), read, format="torch", max_shard_bytes=200)
    assert res.peak_tensor_bytes == 512  # the embedding's shard; the others are smaller
