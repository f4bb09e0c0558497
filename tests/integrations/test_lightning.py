"""tierckpt inside PyTorch Lightning (``tierckpt.integrations.lightning``), with the real
``pytorch-lightning`` from PyPI.

The drills run ``lightning_job.py`` under torchrun (CPU, gloo, 2 ranks): an uninterrupted
run; a run whose rank 1 SIGKILLs itself mid-training and is restarted by torchrun; a third
start with tier 1 wiped that resumes from tier 2 (a ``file://`` directory) alone. Every
per-step row after a resume — loss and learning rate bit for bit, epoch, batch index, the
batch's sample ids, a stateful callback's count — equals the uninterrupted run's. The resume
points are chosen to hit both of Lightning's restart cases: the last batch of an epoch
(step 6 of 6-batch epochs) and the middle of one (step 10). The pure helpers are tested
with values alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._launch import read_jsonl, torchrun
from tests._require import require
from tierckpt.errors import ConfigError
from tierckpt.runtime.events import read_events

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the dev extra installs it
    pl = None

JOB = Path(__file__).with_name("lightning_job.py")
ROW_KEYS = ("step", "loss", "lr", "epoch", "batch_idx", "ids", "batches")


@pytest.fixture(autouse=True)
def _needs_lightning() -> None:
    require(pl is not None, "pytorch-lightning is missing (pip install -e '.[lightning]')")


def _job(out: Path, *args: str, restarts: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torchrun(JOB, "--out", str(out), *args, max_restarts=restarts, timeout=180)


def _rows(out: Path, rank: int) -> list[dict[str, Any]]:
    return read_jsonl(out / f"rows.{rank}.jsonl")


def _same_as(reference: Path, out: Path, steps: list[int], attempt: int | None = None) -> None:
    for rank in (0, 1):
        ref = {r["step"]: r for r in _rows(reference, rank)}
        rows = [r for r in _rows(out, rank) if attempt is None or r["attempt"] == attempt]
        assert [r["step"] for r in rows] == steps, (rank, attempt)
        for row in rows:
            got, want = ({k: r[k] for k in ROW_KEYS} for r in (row, ref[row["step"]]))
            assert got == want, (rank, row["step"])


# --- the drills (real ranks) ---------------------------------------------------------------

@pytest.mark.slow
def test_killed_and_tier2_only_resumes_continue_bit_identically(tmp_path: Path) -> None:
    ref, kill, again = tmp_path / "ref", tmp_path / "kill", tmp_path / "again"
    tier1, tier2 = tmp_path / "tier1", tmp_path / "tier2"
    tier2.mkdir()
    _job(ref, "--tier1", str(ref / "t1"), "--max-steps", "14", "--model-checkpoint")
    ref_rows = _rows(ref, 0)
    # saves after steps 3, 6, 9, 12 and 14 on one TrainState: get_state_dict ran for the
    # first only (the rest reuse its key renaming; tests/test_state_capture.py)
    capture = json.loads((ref / "capture.0.json").read_text())
    assert capture["reference_calls"] == 1 and capture["calls"] >= 5, capture
    assert [r["step"] for r in ref_rows] == list(range(1, 15))
    assert [r["epoch"] for r in ref_rows] == [0] * 6 + [1] * 6 + [2] * 2  # 6 batches/epoch
    assert ref_rows[0]["ids"] != _rows(ref, 1)[0]["ids"]  # a DistributedSampler per rank

    # Saves after steps 3, 6, 9 and the last (10); rank 1 dies before the batch after step
    # 8, once step 6 (the last batch of epoch 0) is committed: the restart resumes there.
    _job(kill, "--tier1", str(tier1), "--tier2", f"file://{tier2}", "--max-steps", "10",
         "--kill-at", "8", "--hang-timeout", "120", restarts=1)
    _same_as(ref, kill, list(range(1, 9)), attempt=0)
    _same_as(ref, kill, list(range(7, 11)), attempt=1)
    assert json.loads((kill / "restored.0.json").read_text()) is None  # a fresh start
    assert json.loads((kill / "restored.1.json").read_text()) == {"step": 6, "source": "tier1"}
    events = read_events(tier1 / "events.jsonl")
    timeline = [e["event"] for e in events if e["rank"] == 0 and e["event"] in (
        "process_start", "pg_ready", "checkpoint_chosen", "state_loaded", "first_step")]
    assert timeline == ["process_start", "pg_ready", "checkpoint_chosen", "first_step",
                        "process_start", "pg_ready", "checkpoint_chosen", "state_loaded",
                        "first_step"]

    # The node's disk is gone: tier 2 alone holds step 10 (mid-epoch 1); run on to step 14.
    shutil.rmtree(tier1)
    _job(again, "--tier1", str(tier1), "--tier2", f"file://{tier2}", "--max-steps", "14",
         "--validate", "--refit-without-resume")
    assert json.loads((again / "restored.0.json").read_text()) == {"step": 10,
                                                                    "source": "tier2"}
    _same_as(ref, again, list(range(11, 15)))

    final = torch.load(again / "final.0.pt", weights_only=True)
    _plain_dcp_load_matches(tier1 / "step-00000014", final)
    for rank in (0, 1):  # trainer.validate(fresh_model, ckpt_path="tierckpt")
        assert json.loads((again / f"eval.{rank}.json").read_text()) == {"same_weights": True}
        error = json.loads((again / f"refit.{rank}.json").read_text())["error"]
        assert "already holds step 14" in error and "ckpt_path='tierckpt'" in error
    _lightning_checkpoints_untouched(ref / "pl", final.keys())


def _plain_dcp_load_matches(step_dir: Path, want: dict[str, torch.Tensor]) -> None:
    """A committed step is a standard DCP checkpoint: ``dcp.load`` alone reads the weights."""
    import torch.distributed.checkpoint as dcp

    from tests.integrations.lightning_job import Net

    got = {"model": Net(48).state_dict()}
    assert not all(torch.equal(got["model"][k], v) for k, v in want.items())
    dcp.load(got, checkpoint_id=str(step_dir), no_dist=True)
    assert got["model"].keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got["model"][key], value), key


def _lightning_checkpoints_untouched(dirpath: Path, model_keys: Any) -> None:
    """A ModelCheckpoint next to TierckptCheckpoint still gets Lightning's own full files."""
    files = sorted(p.name for p in dirpath.glob("*.ckpt"))
    assert files == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt"], files
    ckpt = torch.load(dirpath / files[-1], weights_only=False)
    assert ckpt["state_dict"].keys() == model_keys and ckpt["global_step"] == 10
    assert ckpt["optimizer_states"][0]["state"]


@pytest.mark.slow
def test_model_parallel_fsdp2_resume_bit_identical(tmp_path: Path) -> None:
    """ModelParallelStrategy (FSDP2 over the data-parallel mesh, DTensor state): a kill
    mid-epoch and the resume give the uninterrupted run's rows bit for bit."""
    ref, kill = tmp_path / "ref", tmp_path / "kill"
    common = ("--strategy", "modelparallel", "--max-steps", "10")
    _job(ref, "--tier1", str(ref / "t1"), *common)
    _job(kill, "--tier1", str(tmp_path / "tier1"), *common, "--kill-at", "5", restarts=1)
    _same_as(ref, kill, list(range(1, 6)), attempt=0)
    _same_as(ref, kill, list(range(4, 11)), attempt=1)  # resumed from step 3
    assert json.loads((kill / "restored.1.json").read_text()) == {"step": 3, "source": "tier1"}


# --- in one process -------------------------------------------------------------------------

@pytest.mark.slow
def test_importing_tierckpt_never_imports_lightning(imported_by_tierckpt: frozenset[str]) -> None:
    bad = imported_by_tierckpt & {"pytorch_lightning", "lightning", "lightning_fabric"}
    assert not bad, sorted(bad)


def test_plain_state_keeps_plain_values_and_leaves_out_unsafe_hyper_parameters() -> None:
    from tierckpt.integrations.lightning import plain_state

    checkpoint = {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{}],
                  "global_step": 7, "loops": {"fit_loop": {"x": 1}},
                  "callbacks": {"Cb": {"best": torch.tensor(0.5)}},
                  "hyper_parameters": {"cls": object()}, "hparams_type": type(object())}
    dropped: set[str] = set()
    plain = plain_state(checkpoint, dropped)
    assert plain == {"global_step": 7, "loops": {"fit_loop": {"x": 1}},
                     "callbacks": {"Cb": {"best": torch.tensor(0.5)}}}
    assert dropped == {"hyper_parameters", "hparams_type"}
    assert "state_dict" in checkpoint  # the caller's dict is not changed


def test_plain_state_names_an_entry_a_restart_could_not_read() -> None:
    from tierckpt.integrations.lightning import plain_state

    with pytest.raises(ConfigError, match=r"checkpoint\['MyDataModule'\].*weights_only"):
        plain_state({"global_step": 1, "MyDataModule": {"tokenizer": object()}})


def _fit_loop(processed: int, completed: int, last: bool) -> dict[str, Any]:
    loader = {"_num_yielded": 6, "_iterator_finished": False}
    return {"loops": {"fit_loop": {
        "epoch_progress": {"current": {"processed": processed}},
        "epoch_loop.batch_progress": {"total": {"completed": completed, "processed": 6},
                                      "is_last_batch": last},
        "state_dict": {"combined_loader": [loader]}}}}


def test_resumed_epoch_mid_epoch_and_after_the_last_batch() -> None:
    from tierckpt.integrations.lightning import resumed_epoch

    mid = _fit_loop(processed=1, completed=5, last=False)
    assert resumed_epoch(mid) == 1
    assert mid["loops"]["fit_loop"]["state_dict"]["combined_loader"][0][
        "_iterator_finished"] is False
    end = _fit_loop(processed=1, completed=5, last=True)  # saved on the epoch's last batch
    assert resumed_epoch(end) == 2
    assert end["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_iterator_finished"]
    assert resumed_epoch({"global_step": 3}) is None


def test_the_callback_needs_a_tierckpt_strategy(tmp_path: Path) -> None:
    from tests.integrations.lightning_job import Net
    from tierckpt.integrations.lightning import TierckptCheckpoint

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                         callbacks=[TierckptCheckpoint(every_n_steps=1)],
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match="needs a tierckpt strategy"):
        trainer.fit(Net(8))
    with pytest.raises(ConfigError, match="every_n_steps"):
        TierckptCheckpoint(every_n_steps=0)
