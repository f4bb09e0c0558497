"""``export`` (the library call): consolidated safetensors/torch files of a real checkpoint,
names mapped, dtype cast, atomic replacement of an earlier export only, no code run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests._payload import REFUSED, plant_metadata_payload
from tests.share._ckpt import save_steps
from tierckpt.errors import ConfigError, UnsafeCheckpointError
from tierckpt.format import layout
from tierckpt.share.export import export, parse_dtype
from tierckpt.share.source import open_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("export") / "t1"
    return root, save_steps(root)


def _read_all(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got.update(load_file(out / f))
    return got


def test_sharded_safetensors_equal_the_model(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, weights = saved
    s = export(root, tmp_path / "out", max_shard_bytes=20_000)
    assert s.step == 2 and s.result.tensors == 4
    assert sum(f.name.endswith(".safetensors") for f in s.result.files) >= 2
    got = _read_all(tmp_path / "out")
    assert set(got) == set(weights[2]) and all(torch.equal(got[k], weights[2][k]) for k in got)
    with open_checkpoint(root) as ckpt:  # the optimizer's records were never read
        assert s.bytes_read < 0.5 * ckpt.manifest.total_bytes
    assert s.result.peak_tensor_bytes == max(v.numel() * 4 for v in weights[2].values())


def test_names_and_dtype(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, weights = saved
    export(root, tmp_path / "out", strip_prefix="0.", add_prefix="model.",
           dtype=parse_dtype("bf16"), step=1)
    got = _read_all(tmp_path / "out")
    assert set(got) == {"model.weight", "model.bias", "model.2.weight", "model.2.bias"}
    assert got["model.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.weight"], weights[1]["0.weight"].to(torch.bfloat16))
    with pytest.raises(ConfigError, match="not a floating dtype"):
        parse_dtype("int8")


def test_torch_format(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, weights = saved
    export(root, tmp_path / "out", format="torch")
    got = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(got[k], weights[2][k]) for k in weights[2])


def test_replaces_only_an_earlier_export_and_only_with_force(saved: tuple[Path, dict],
                                                             tmp_path: Path) -> None:
    root, _ = saved
    out = tmp_path / "out"
    export(root, out, step=1)
    with pytest.raises(ConfigError, match="--force"):
        export(root, out)
    export(root, out, force=True)  # an earlier export (SHA256SUMS): replaced
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["tierckpt_step"] == "2"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an earlier export"):
        export(root, mine, force=True)
    assert (mine / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # no debris


def test_bad_keys_and_config(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = saved
    with pytest.raises(ConfigError, match="its keys are model, optim, rank_state"):
        export(root, tmp_path / "o", keys=("weights",))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        export(root, tmp_path / "o", hf_config=bad)
    assert not (tmp_path / "o").exists()


def test_a_planted_metadata_payload_never_runs(saved: tuple[Path, dict],
                                               tmp_path: Path) -> None:
    root = tmp_path / "t1"
    shutil.copytree(saved[0], root)
    marker = tmp_path / "pwned"
    plant_metadata_payload(root / layout.step_dirname(2), marker)
    with pytest.raises(UnsafeCheckpointError, match=REFUSED):
        export(root, tmp_path / "out", step=2)
    assert not marker.exists() and not (tmp_path / "out").exists()
    # "latest" skips it (with the reason) and exports the older step instead
    assert export(root, tmp_path / "out").step == 1 and not marker.exists()
