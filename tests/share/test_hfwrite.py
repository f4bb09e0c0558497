"""tierckpt.share.hfwrite: the plan (pure), the safetensors bytes against the reference
implementation, the one-tensor memory bound, the commit, and a round trip through
``transformers``' ``from_pretrained``."""

from __future__ import annotations

import json
import shutil
import subprocess
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._require import require
from tierckpt.errors import ConfigError
from tierckpt.share.hfwrite import (
    SHA256SUMS,
    TensorSpec,
    output_dtype,
    plan_shards,
    safetensors_header,
    shard_names,
    write_hf,
)

try:
    import safetensors.torch as st
    from safetensors import safe_open
    HAVE_SAFETENSORS = True
except ImportError:  # pragma: no cover - the share extra is missing
    HAVE_SAFETENSORS = False


def _st() -> None:
    require(HAVE_SAFETENSORS, "needs safetensors (pip install 'tierckpt[share]')")


def _mixed() -> dict[str, torch.Tensor]:
    """Every kind of tensor a training checkpoint holds, with their sizes in bytes."""
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),          # f32, 512
        "model.layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),  # bf16, 128
        "model.step": torch.tensor(12345678901, dtype=torch.int64),             # 0-d i64, 8
        "model.mask": torch.rand(5, 3, generator=g) > 0.5,                      # bool, 15
        "model.empty": torch.empty(0, 4),                                       # f32, 0
        "model.ids": torch.randint(-2**40, 2**40, (7,), generator=g),           # i64, 56
        "lm_head.weight": torch.randn(4, 8, generator=g),                       # f32, 128
    }


# max_shard_bytes=200: the 512-byte embedding alone; then 128+8+15+0 = 151, and 56 more
# would exceed 200; then 56+128 = 184.
PLAN_200 = [["model.embed_tokens.weight"],
            ["model.layers.0.w", "model.step", "model.mask", "model.empty"],
            ["model.ids", "lm_head.weight"]]


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]


def _reader(tensors: dict[str, torch.Tensor]) -> Callable[[TensorSpec], torch.Tensor]:
    return lambda spec: tensors[spec.name].clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(_bits(got), _bits(want)), name


def _load_all(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of an export via the reference loader, and which file held it."""
    loaded: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in sorted(out.glob("*.safetensors")):
        for k, v in st.load_file(f).items():
            assert k not in loaded
            loaded[k], where[k] = v, f.name
    return loaded, where


# --- the plan: values only -----------------------------------------------------------------


def test_plan_is_greedy_in_order_and_an_oversized_tensor_gets_its_own_shard() -> None:
    plan = plan_shards(_specs(_mixed()), max_shard_bytes=200, dtype=None)
    assert [[s.name for s in shard] for shard in plan] == PLAN_200
    assert len(plan_shards(_specs(_mixed()), max_shard_bytes=10**9, dtype=None)) == 1
    # sizes are after the cast: at 300 bytes, f32 gives 512 | 128+8+15+0+56 = 207 (+128 > 300)
    # | 128, bf16 halves the f32 tensors: 256 (+128 > 300) | 128+8+15+0+56+64 = 271
    assert [len(s) for s in plan_shards(_specs(_mixed()), max_shard_bytes=300,
                                        dtype=None)] == [1, 5, 1]
    assert [len(s) for s in plan_shards(_specs(_mixed()), max_shard_bytes=300,
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


# --- safetensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit, shards", [(10**9, 1), (200, 3)])
def test_safetensors_round_trip_is_bit_exact(tmp_path: Path, limit: int, shards: int) -> None:
    _st()
    tensors = _mixed()
    out = tmp_path / "hf"
    res = write_hf(out, _specs(tensors), _reader(tensors), max_shard_bytes=limit)
    names = shard_names("safetensors", shards)
    assert sorted(p.name for p in out.glob("*.safetensors")) == names
    loaded, where = _load_all(out)
    assert loaded.keys() == tensors.keys()
    for k, want in tensors.items():
        _assert_bit_equal(loaded[k], want, k)
    total = sum(t.nbytes for t in tensors.values())
    assert (res.tensors, res.tensor_bytes) == (len(tensors), total)
    index = out / "model.safetensors.index.json"
    if shards == 1:
        assert not index.exists()  # as save_pretrained: an index only when sharded
        return
    doc = json.loads(index.read_text())
    assert doc == {"metadata": {"total_size": total}, "weight_map": where}
    assert [sorted(k for k, f in where.items() if f == n) for n in names] == \
        [sorted(shard) for shard in PLAN_200]
    assert [f.name for f in res.files] == [*names, index.name, SHA256SUMS]


@pytest.mark.parametrize("pad", range(8))
def test_bytes_equal_the_reference_writer(tmp_path: Path, pad: int) -> None:
    """In the reference's own order (dtype, then name) the whole file is byte-identical to
    ``safetensors.torch.save``: header JSON, space padding to a multiple of 8, offsets."""
    _st()
    g = torch.Generator().manual_seed(pad)
    tensors = {"i" + "x" * pad: torch.randint(0, 9, (3,), generator=g),
               "s": torch.tensor(2.5),
               "w": torch.randn(2, 3, generator=g),
               "h": torch.randn(5, generator=g).to(torch.float16),
               "e": torch.empty(0, 2, dtype=torch.int8),
               "m": torch.tensor([True, False, True])}
    write_hf(tmp_path / "o", _specs(tensors), _reader(tensors))
    ours = (tmp_path / "o" / "model.safetensors").read_bytes()
    assert ours == st.save(tensors, metadata={"format": "pt"})
    n = int.from_bytes(ours[:8], "little")
    assert n % 8 == 0 and ours[8 + n - 1:8 + n] in (b" ", b"}")


def test_every_tensor_is_aligned_whatever_the_given_order(tmp_path: Path) -> None:
    _st()
    tensors = {"mask": torch.ones(3, dtype=torch.bool), "f": torch.randn(3),
               "h": torch.randn(1).half(), "i": torch.arange(3)}
    write_hf(tmp_path / "o", _specs(tensors), _reader(tensors))
    raw = (tmp_path / "o" / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header.pop("__metadata__") == {"format": "pt"}
    for name, entry in header.items():
        assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name
    loaded, _ = _load_all(tmp_path / "o")
    for k, want in tensors.items():
        _assert_bit_equal(loaded[k], want, k)


def test_header_is_padded_to_eight_and_metadata_is_kept(tmp_path: Path) -> None:
    _st()
    specs = [TensorSpec("a", (2,), torch.float32)]
    header = safetensors_header(specs, None, {"k": "v"})
    assert (len(header) - 8) % 8 == 0 and int.from_bytes(header[:8], "little") == len(header) - 8
    out = tmp_path / "o"
    write_hf(out, specs, lambda s: torch.ones(2), metadata={"source": "step-7"})
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "source": "step-7"}
        assert torch.equal(f.get_tensor("a"), torch.ones(2))


def test_cast_to_bfloat16_leaves_integers_and_bools_alone(tmp_path: Path) -> None:
    _st()
    tensors = _mixed()
    res = write_hf(tmp_path / "o", _specs(tensors), _reader(tensors), dtype=torch.bfloat16,
                   max_shard_bytes=200)
    loaded, _ = _load_all(tmp_path / "o")
    for k, src in tensors.items():
        want = src.to(torch.bfloat16) if src.is_floating_point() else src
        _assert_bit_equal(loaded[k], want, k)
    assert res.tensor_bytes == sum(t.nbytes for t in loaded.values())
    with pytest.raises(ConfigError, match="floating"):
        write_hf(tmp_path / "p", _specs(tensors), _reader(tensors), dtype=torch.int32)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_read_k_happens_after_tensor_k_minus_1_was_freed(tmp_path: Path,
                                                         dtype: torch.dtype | None) -> None:
    """The RAM bound: the writer holds one tensor (and its cast copy), never a shard."""
    tensors = _mixed()
    refs: list[weakref.ref[torch.Tensor]] = []

    def read(spec: TensorSpec) -> torch.Tensor:
        if refs:
            assert refs[-1]() is None, f"{spec.name} read while the previous is alive"
        t = tensors[spec.name].clone()
        refs.append(weakref.ref(t))
        return t

    res = write_hf(tmp_path / "o", _specs(tensors), read, dtype=dtype, max_shard_bytes=10**9)
    assert len(refs) == len(tensors) and refs[-1]() is None
    biggest = max(t.nbytes for t in tensors.values())  # the f32 embedding
    assert res.peak_tensor_bytes == (biggest if dtype is None else biggest * 3 // 2)


def test_progress_is_reported_after_each_tensor(tmp_path: Path) -> None:
    tensors = _mixed()
    calls: list[tuple[int, int]] = []
    res = write_hf(tmp_path / "o", _specs(tensors), _reader(tensors), max_shard_bytes=200,
                   progress=lambda done, total: calls.append((done, total)))
    assert len(calls) == len(tensors)
    assert {t for _, t in calls} == {res.tensor_bytes}
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1][0] == res.tensor_bytes


# --- commit, checksums, failures -------------------------------------------------------------


def test_sha256sum_check_passes(tmp_path: Path) -> None:
    require(shutil.which("sha256sum") is not None, "needs sha256sum (coreutils)")
    tensors = _mixed()
    out = tmp_path / "o"
    res = write_hf(out, _specs(tensors), _reader(tensors), max_shard_bytes=200,
                   extra_files={"config.json": b'{"model_type": "x"}\n'})
    proc = subprocess.run(["sha256sum", "--strict", "-c", SHA256SUMS], cwd=out,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = [line.split("  ")[1] for line in (out / SHA256SUMS).read_text().splitlines()]
    assert listed == [f.name for f in res.files[:-1]]
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in res.files)
    assert all(f.size == (out / f.name).stat().st_size for f in res.files)
    assert (out / "config.json").read_bytes() == b'{"model_type": "x"}\n'


def test_an_existing_out_dir_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(ConfigError, match="--force"):
        write_hf(out, [TensorSpec("a", (1,), torch.float32)], lambda s: torch.zeros(1))
    assert [p.name for p in out.iterdir()] == ["keep"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


@pytest.mark.parametrize("format", ["safetensors", "torch"])
@pytest.mark.parametrize("failure", ["raises", "wrong shape", "wrong dtype", "not a tensor"])
def test_a_failed_read_leaves_nothing_behind(tmp_path: Path, format: str, failure: str) -> None:
    tensors = _mixed()
    parent = tmp_path / "exports"
    parent.mkdir()
    bad = "model.ids"  # in the last shard: earlier shards were written already

    def read(spec: TensorSpec) -> torch.Tensor | list[int]:
        t = tensors[spec.name].clone()
        if spec.name != bad:
            return t
        if failure == "raises":
            raise OSError("disk gone")
        if failure == "wrong shape":
            return t[:3]
        if failure == "wrong dtype":
            return t.int()
        return t.tolist()

    expected = OSError if failure == "raises" else ValueError
    with pytest.raises(expected, match="disk gone" if failure == "raises" else bad):
        write_hf(parent / "o", _specs(tensors), read, format=format,  # type: ignore[arg-type]
                 max_shard_bytes=200)
    assert list(parent.iterdir()) == []


def test_a_bad_extra_file_name_is_refused_before_writing(tmp_path: Path) -> None:
    for name in ("../x", ".hidden", SHA256SUMS, "model.safetensors"):
        with pytest.raises(ConfigError, match="plain file name"):
            write_hf(tmp_path / "o", [TensorSpec("a", (1,), torch.float32)],
                     lambda s: torch.zeros(1), extra_files={name: b""})
    assert list(tmp_path.iterdir()) == []


# --- torch format ----------------------------------------------------------------------------


@pytest.mark.parametrize("limit, shards", [(10**9, 1), (200, 3)])
def test_torch_format_round_trip(tmp_path: Path, limit: int, shards: int) -> None:
    tensors = _mixed()
    tensors["view"] = torch.arange(100.0)[10:14]  # a view: only its 4 elements are saved
    out = tmp_path / "o"
    res = write_hf(out, _specs(tensors), lambda s: tensors[s.name], format="torch",
                   max_shard_bytes=limit)
    names = shard_names("torch", shards)
    loaded: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for name in names:
        part = torch.load(out / name, weights_only=True)
        loaded |= part
        where |= dict.fromkeys(part, name)
    assert loaded.keys() == tensors.keys()
    for k, want in tensors.items():
        _assert_bit_equal(loaded[k], want, k)
    assert loaded["view"].untyped_storage().nbytes() == 16
    index = out / "pytorch_model.bin.index.json"
    assert index.exists() == (shards > 1)
    if shards > 1:
        assert json.loads(index.read_text()) == {
            "metadata": {"total_size": res.tensor_bytes}, "weight_map": where}


def test_torch_format_holds_one_shard_at_a_time(tmp_path: Path) -> None:
    tensors = _mixed()
    plan = [set(names) for names in PLAN_200]
    refs: dict[str, weakref.ref[torch.Tensor]] = {}

    def read(spec: TensorSpec) -> torch.Tensor:
        shard = next(i for i, names in enumerate(plan) if spec.name in names)
        if shard and spec.name == PLAN_200[shard][0]:  # first of a shard: the last is gone
            assert all(refs[n]() is None for n in PLAN_200[shard - 1])
        t = tensors[spec.name].clone()
        refs[spec.name] = weakref.ref(t)
        return t

    res = write_hf(tmp_path / "o", _specs(tensors), read, format="torch", max_shard_bytes=200)
    assert res.peak_tensor_bytes == 512  # the embedding's shard; the others are smaller


# --- transformers ----------------------------------------------------------------------------


def test_from_pretrained_gives_the_same_logits(tmp_path: Path) -> None:
    _st()
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:  # pragma: no cover
        require(False, "needs transformers (the dev extra)")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    state = model.state_dict()
    out = tmp_path / "llama"
    res = write_hf(out, _specs(state), _reader(state), max_shard_bytes=16_384)
    config.save_pretrained(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == state.keys()
    shards = [f for f in res.files if f.name.endswith(".safetensors")]
    assert len(shards) >= 3
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 63, 0, 17]])
    with torch.no_grad():
        want = model(ids).logits
        got = loaded(ids).logits
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
