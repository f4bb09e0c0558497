"""tierckpt.share.hfwrite: write_hf end to end: round trips in both formats, progress, the
commit (``SHA256SUMS``, nothing left behind on a failure, refusals before writing), and a
round trip through ``transformers``' ``from_pretrained``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests._require import require
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
from tierckpt.share.hfplan import SHA256SUMS, TensorSpec, shard_names
from tierckpt.share.hfwrite import write_hf


@pytest.mark.parametrize("limit, shards", [(10**9, 1), (200, 3)])
def test_safetensors_round_trip_is_bit_exact(tmp_path: Path, limit: int, shards: int) -> None:
    need_safetensors()
    tensors = mixed()
    out = tmp_path / "hf"
    res = write_hf(out, specs_of(tensors), reader(tensors), max_shard_bytes=limit)
    names = shard_names("safetensors", shards)
    assert sorted(p.name for p in out.glob("*.safetensors")) == names
    loaded, where = load_all(out)
    assert loaded.keys() == tensors.keys()
    for k, want in tensors.items():
        assert_bit_equal(loaded[k], want, k)
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


def test_progress_is_reported_after_each_tensor(tmp_path: Path) -> None:
    tensors = mixed()
    calls: list[tuple[int, int]] = []
    res = write_hf(tmp_path / "o", specs_of(tensors), reader(tensors), max_shard_bytes=200,
                   progress=lambda done, total: calls.append((done, total)))
    assert len(calls) == len(tensors)
    assert {t for _, t in calls} == {res.tensor_bytes}
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1][0] == res.tensor_bytes


# --- commit, checksums, failures -------------------------------------------------------------


def test_sha256sum_check_passes(tmp_path: Path) -> None:
    require(shutil.which("sha256sum") is not None, "needs sha256sum (coreutils)")
    tensors = mixed()
    out = tmp_path / "o"
    res = write_hf(out, specs_of(tensors), reader(tensors), max_shard_bytes=200,
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
    tensors = mixed()
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
        write_hf(parent / "o", specs_of(tensors), read, format=format,  # type: ignore[arg-type]
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
    tensors = mixed()
    tensors["view"] = torch.arange(100.0)[10:14]  # a view: only its 4 elements are saved
    out = tmp_path / "o"
    res = write_hf(out, specs_of(tensors), lambda s: tensors[s.name], format="torch",
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
        assert_bit_equal(loaded[k], want, k)
    assert loaded["view"].untyped_storage().nbytes() == 16
    index = out / "pytorch_model.bin.index.json"
    assert index.exists() == (shards > 1)
    if shards > 1:
        assert json.loads(index.read_text()) == {
            "metadata": {"total_size": res.tensor_bytes}, "weight_map": where}


# --- transformers ----------------------------------------------------------------------------


def test_from_pretrained_gives_the_same_logits(tmp_path: Path) -> None:
    need_safetensors()
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
    res = write_hf(out, specs_of(state), reader(state), max_shard_bytes=16_384)
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
