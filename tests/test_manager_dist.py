"""CheckpointManager with real ranks: FSDP2 + gloo under torchrun, real SIGKILLs, real files.

The workload is tests/workloads/fsdp_train.py. Reference runs are uninterrupted; every
killed run must reproduce the reference's per-step losses bit for bit after its resume.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests._launch import WORKLOADS, read_jsonl, torchrun
from tests._references import FSDP_STEPS, FsdpReference

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

TRAIN = WORKLOADS / "fsdp_train.py"
STEPS = FSDP_STEPS


def _run(tmp: Path, name: str, *extra: str, nproc: int = 2, restarts: int = 0,
         steps: int = STEPS) -> tuple[Path, Path]:
    tier1, losses = tmp / f"{name}-tier1", tmp / f"{name}-losses.jsonl"
    torchrun(TRAIN, "--tier1", str(tier1), "--losses", str(losses), "--steps", str(steps),
             *extra, nproc=nproc, max_restarts=restarts)
    return tier1, losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory,
              fsdp_reference: FsdpReference) -> dict[int, tuple[Path, Path, Path]]:
    """Uninterrupted 2- and 4-rank runs: (tier1, losses, full state dumped at the last save).
    The 2-rank one is the session's ``fsdp_reference`` (tests/conftest.py)."""
    tmp = tmp_path_factory.mktemp("reference")
    dump = tmp / "saved-4.pt"
    tier1, losses = _run(tmp, "ref4", "--dump-saved", str(dump), nproc=4)
    ref2 = fsdp_reference
    return {2: (ref2.tier1, ref2.losses, ref2.saved), 4: (tier1, losses, dump)}


def _losses_by_step(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(path)}


def _restores(tier1: Path) -> list[dict]:
    return [e for e in read_jsonl(tier1 / "events.jsonl") if e["event"] == "restore_done"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_sigkill_between_saves_resumes_bit_identical(nproc: int, reference: dict,
                                                     tmp_path: Path) -> None:
    _, ref_losses, _ = reference[nproc]
    tier1, losses = _run(tmp_path, "kill", "--kill-at", "9", "--kill-rank", str(nproc - 1),
                         "--kill-after-commit", nproc=nproc, restarts=1)
    rows = read_jsonl(losses)
    after = [r for r in rows if r["attempt"] == 1]
    restores = _restores(tier1)
    assert {r["step"] for r in restores} == {7}, restores  # resumed from the last commit
    assert [r["step"] for r in after] == [8, 9, 10, 11]
    ref = _losses_by_step(ref_losses)
    assert [r["loss"] for r in after] == [ref[r["step"]] for r in after]  # exact, not approx


@pytest.mark.slow
def test_sigkill_during_background_write_leaves_no_complete(tmp_path: Path,
                                                            reference: dict) -> None:
    # Rank 1 dies right after save(7) returns: step 7 must never be committed by attempt 0,
    # so attempt 1 resumes from step 3 and still reproduces the reference exactly.
    tier1, losses = _run(tmp_path, "killwrite", "--kill-at", "7", "--kill-rank", "1",
                         restarts=1)
    restores = _restores(tier1)
    assert {r["step"] for r in restores} == {3}, restores
    committed = [e for e in read_jsonl(tier1 / "events.jsonl")
                 if e["event"] == "save_committed" and e["step"] == 7]
    pids_attempt1 = {e["pid"] for e in restores}
    assert committed and all(e["pid"] in pids_attempt1 for e in committed)
    ref = _losses_by_step(reference[2][1])
    after = [r for r in read_jsonl(losses) if r["attempt"] == 1]
    assert [r["step"] for r in after] == list(range(4, STEPS))
    assert [r["loss"] for r in after] == [ref[r["step"]] for r in after]


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for k in a["optim"]:
        for kk in a["optim"][k]:
            assert torch.equal(a["optim"][k][kk], b["optim"][k][kk]), (k, kk)


@pytest.mark.slow
@pytest.mark.parametrize("new_world", [1, 3])
def test_reshard_2_to_new_world(new_world: int, reference: dict, tmp_path: Path) -> None:
    src_tier1, _, saved_dump = reference[2]
    tier1 = tmp_path / "tier1"
    shutil.copytree(src_tier1, tier1)
    restored_dump, losses = tmp_path / "restored.pt", tmp_path / "losses.jsonl"
    torchrun(TRAIN, "--tier1", str(tier1), "--losses", str(losses), "--steps", "16",
             "--dump-restored", str(restored_dump), nproc=new_world)
    saved, restored = torch.load(saved_dump), torch.load(restored_dump)
    assert saved["step"] == restored["step"] == 11
    _assert_state_equal(saved, restored)
    info = _restores(tier1)[0]
    assert (info["saved_world_size"], info["world_size"]) == (2, new_world)
    after = read_jsonl(losses)
    assert [r["step"] for r in after] == [12, 13, 14, 15]  # training continued
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in after)


def test_plain_dcp_load_reads_committed_checkpoint(reference: dict) -> None:
    import sys
    sys.path.insert(0, str(WORKLOADS))
    from fsdp_train import TinyGPT

    tier1, _, saved_dump = reference[2]
    model_sd = TinyGPT().state_dict()
    dcp.load({"model": model_sd}, checkpoint_id=str(tier1 / "step-00000011"))
    saved = torch.load(saved_dump)
    for k, v in saved["model"].items():
        assert torch.equal(model_sd[k], v), k
