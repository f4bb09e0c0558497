"""``tierckpt.load`` in one process (no process group): from a tier-1 root, a step
directory and a file:// tier 2; only the requested records are read, each verified."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tests._payload import REFUSED, plant_metadata_payload
from tests.share._ckpt import drop_chunk_crcs, flip_byte, mlp, record, save_steps
from tierckpt.errors import (
    ConfigError,
    CorruptDataError,
    NoCheckpointError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.share.contents import contents
from tierckpt.share.source import open_checkpoint
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage
from tierckpt.tier2.uploader.transfer import upload_step


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("share") / "t1"
    return root, save_steps(root)


@pytest.fixture
def root(saved: tuple[Path, dict], tmp_path: Path) -> Path:
    """A private copy of the saved tier-1 root (tests damage it)."""
    dst = tmp_path / "t1"
    shutil.copytree(saved[0], dst)
    return dst


def _equal(module: nn.Module, want: dict[str, torch.Tensor]) -> bool:
    got = module.state_dict()
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_is_public() -> None:
    assert tierckpt.load.__module__ == "tierckpt.share.loader"


def test_newest_model_into_a_module_reads_only_the_model(saved: tuple[Path, dict]) -> None:
    root, weights = saved
    model = mlp(seed=99)
    r = tierckpt.load(root, model)
    assert r.step == 2 and r.tier == "tier1" and r.verified == "chunks" and not r.notes
    assert _equal(model, weights[2])
    with open_checkpoint(root) as ckpt:
        model_stored = contents(ckpt).totals()["model"]["stored_bytes"]
        meta = ckpt.entry(layout.METADATA).size
    # the model's records, .metadata, manifest and marker — nothing of the optimizer
    assert model_stored + meta < r.bytes_read < model_stored + meta + 16_384
    assert r.bytes_read < 0.5 * r.checkpoint_bytes


def test_sources_step_dir_and_tier2_url_and_a_given_step(saved: tuple[Path, dict],
                                                         tmp_path: Path) -> None:
    root, weights = saved
    model = mlp(seed=5)
    assert tierckpt.load(root / layout.step_dirname(1), model).step == 1
    assert _equal(model, weights[1])
    assert tierckpt.load(root, model, step=2).step == 2 and _equal(model, weights[2])
    # a file:// tier 2 laid out as the uploader did before issue 41 (layout 1):
    # <prefix>/step-XXXXXXXX/<member>
    store = tmp_path / "bucket"
    shutil.copytree(root / layout.step_dirname(2), store / layout.step_dirname(2))
    r = tierckpt.load(store.as_uri(), mlp(seed=7))
    assert r.tier == "tier2" and r.step == 2
    with pytest.raises(NoCheckpointError, match="step 9"):
        tierckpt.load(root, model, step=9)


def test_a_content_addressed_tier2_reads_ranges_through_its_map(
        saved: tuple[Path, dict], root: Path, tmp_path: Path) -> None:
    """Both steps uploaded (layout 2): each member's ranges come from its content object
    through the step's map, each verified; a damaged object is caught, never loaded."""
    weights = saved[1]
    store = tmp_path / "bucket"
    store.mkdir()
    remote = Tier2Catalog(LocalStorage(store))
    for step in (1, 2):
        r = upload_step(Tier1Catalog(root), remote, step,
                        log=events.EventLog(root / layout.EVENTS))
        assert r.status == "verified"
    for step in (1, 2):
        model = mlp(seed=7)
        got = tierckpt.load(store.as_uri(), model, step=step)
        assert (got.tier, got.step, got.verified) == ("tier2", step, "chunks")
        assert _equal(model, weights[step])
    path, offset, length = record(root, 2, "model.0.weight")
    flip_byte(store / remote.resolve(2).key(path.name), offset + length // 2)
    with pytest.raises(CorruptDataError, match=r"model\.0\.weight.*CRC32C"):
        tierckpt.load(store.as_uri(), mlp(seed=7), step=2)


def test_into_none_and_several_keys(saved: tuple[Path, dict]) -> None:
    root, weights = saved
    r = tierckpt.load(root)
    assert set(r.state_dict) == set(weights[2])
    assert all(torch.equal(r.state_dict[k], weights[2][k]) for k in weights[2])
    both = tierckpt.load(root, keys=("model", "optim"))
    assert set(both.state_dict) == {"model", "optim"}
    assert "state.0.weight.exp_avg" in both.state_dict["optim"]
    assert both.bytes_read > 2.5 * r.bytes_read  # the optimizer is twice the model
    sd = {k: torch.zeros_like(v) for k, v in weights[2].items()}
    tierckpt.load(root, sd)  # a plain state dict, filled in place
    assert all(torch.equal(sd[k], weights[2][k]) for k in sd)


def test_a_flipped_byte_in_a_model_record_is_caught_by_its_range_check(root: Path) -> None:
    path, offset, length = record(root, 2, "model.0.weight")
    flip_byte(path, offset + length // 2)
    with pytest.raises(CorruptDataError, match=r"model\.0\.weight.*CRC32C"):
        tierckpt.load(root, mlp())


def test_a_flipped_byte_in_the_optimizer_does_not_affect_a_model_load(
        root: Path, saved: tuple[Path, dict]) -> None:
    path, offset, length = record(root, 2, "optim.state.0.weight.exp_avg")
    flip_byte(path, offset + length // 2)
    model = mlp(seed=3)
    r = tierckpt.load(root, model)
    assert r.step == 2 and r.verified == "chunks" and _equal(model, saved[1][2])
    with pytest.raises(CorruptDataError, match="exp_avg"):
        tierckpt.load(root, keys=("optim",))


def test_an_older_manifest_falls_back_to_whole_file_verification(
        root: Path, saved: tuple[Path, dict]) -> None:
    drop_chunk_crcs(root / layout.step_dirname(2))
    model = mlp(seed=3)
    r = tierckpt.load(root, model)
    assert r.verified == "files" and _equal(model, saved[1][2])
    assert any("predates per-record CRC32C" in n for n in r.notes)
    assert r.bytes_read >= r.checkpoint_bytes - 16_384  # whole files were read
    path, offset, _length = record(root, 2, "optim.state.0.weight.exp_avg")
    flip_byte(path, offset + 5)  # in the same file: the whole-file check catches it
    with pytest.raises(CorruptDataError, match="CRC32C"):
        tierckpt.load(root, mlp())


def test_verify_files_reads_whole_files(saved: tuple[Path, dict]) -> None:
    for verify in ("files", tierckpt.ReadCheck.FILES):
        r = tierckpt.load(saved[0], mlp(seed=1), verify=verify)
        assert r.verified == "files" and any("verify='files'" in n for n in r.notes)
    with pytest.raises(ConfigError, match=r"verify must be one of \['chunks', 'files'\]"):
        tierckpt.load(saved[0], mlp(), verify="none")  # type: ignore[arg-type]


def test_the_result_repr_is_a_summary_not_every_tensor(saved: tuple[Path, dict]) -> None:
    r = tierckpt.load(saved[0])
    text = repr(r)
    assert r.state_dict and "state_dict" not in text and "tensor(" not in text
    assert f"step={r.step}" in text and len(text) < 600


def test_a_newer_checkpoint_that_does_not_verify_is_skipped_with_its_reason(
        root: Path, saved: tuple[Path, dict]) -> None:
    (root / layout.step_dirname(2) / layout.MANIFEST).write_text("{}")  # the parts rebuild
    (root / layout.step_dirname(2) / layout.part_filename(0)).write_text("{}")  # ... not now
    model = mlp(seed=3)
    r = tierckpt.load(root, model)
    assert r.step == 1 and _equal(model, saved[1][1])
    assert any(n.startswith("skipped step 2") for n in r.notes)
    (root / layout.step_dirname(1) / layout.COMPLETE).unlink()  # now nothing is committed
    with pytest.raises(NoCheckpointError, match="step 2"):
        tierckpt.load(root, model)


def test_bad_input_says_what_to_fix(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root = saved[0]
    with pytest.raises(ConfigError, match="its keys are model, optim, rank_state"):
        tierckpt.load(root, keys=("weights",))
    with pytest.raises(StateMismatchError, match=r"model\.0\.weight: checkpoint \(128, 64\)"):
        tierckpt.load(root, nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)))
    with pytest.raises(ConfigError, match="not a directory or a tier-2 URL"):
        tierckpt.load(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="several keys"):
        tierckpt.load(root, mlp(), keys=("model", "optim"))
    with pytest.raises(ConfigError, match="step"):
        tierckpt.load(root, step=-1)


def test_strict_false_loads_the_common_entries(saved: tuple[Path, dict]) -> None:
    root, weights = saved
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8), nn.Linear(8, 2))
    tierckpt.load(root, model, strict=False)
    assert torch.equal(model[0].weight, weights[2]["0.weight"])
    assert torch.equal(model[2].bias, weights[2]["2.bias"])


def test_a_planted_metadata_payload_never_runs(root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    plant_metadata_payload(root / layout.step_dirname(2), marker, where="storage_data")
    with pytest.raises(UnsafeCheckpointError, match=REFUSED):
        tierckpt.load(root, mlp(), step=2)
    assert not marker.exists()
