"""``tierckpt.integrations.torchtitan`` with real torchtitan (0.3) pieces on CPU.

Two-rank jobs (FSDP2 over gloo, torchrun) run ``titan_train.py``, which builds what
torchtitan's Trainer builds (its optimizer and LR scheduler containers, a
``ParallelAwareDataloader``, a train state) and calls the checkpointer in ``trainer.py``'s
order: an uninterrupted run is the reference; a run SIGKILLed after step 10 and restarted by
torchrun, and a run resumed from tier 2 alone, must log the same bits for every step. The
reference's checkpoint loads with plain ``dcp.load``. In-process tests (one process, no
process group) cover the round trip of every piece, ``exclude_from_loading``,
``initial_load_path`` from a stock torchtitan checkpoint, torchtitan's CLI, and each
refusal.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from tests._require import require
from tests.integrations import _runs as runs

JOB = Path(__file__).parent / "titan_train.py"
HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
COMPARED = ("loss_hex", "lr", "ntokens_seen")  # all but "attempt"


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    _require_torchtitan()


def _require_torchtitan() -> None:
    require(HAVE_TORCHTITAN, "torchtitan is not installed: pip install 'tierckpt[torchtitan]' "
            "(or the no-deps set in docs/integrations/torchtitan.md)")


def _train(tmp: Path, name: str, *args: str, restarts: int = 0) -> list[dict[str, Any]]:
    return runs.train(JOB, tmp, name, *args, restarts=restarts)


_restored = runs.restored


def _assert_same_as(ref: dict[int, dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    runs.assert_same_as(ref, rows, COMPARED)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    _require_torchtitan()  # a module fixture runs before the function-scoped autouse one
    tmp = tmp_path_factory.mktemp("titan-ref")
    rows = _train(tmp, "ref", "--weights-out", str(tmp / "final.pt"))
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert _restored(tmp, "ref") == []  # a fresh start: nothing to restore
    # saves: step 1 (enable_first_step_checkpoint), every 3rd, the last; keep_latest_k=3
    assert sorted(p.name for p in (tmp / "ref").glob("step-*")) == [
        "step-00000012", "step-00000015", "step-00000016"]
    return tmp, {r["step"]: r for r in rows}


# -- two ranks, torchrun ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("source", ["tier1", "tier0"])
def test_killed_and_restarted_resumes_bit_identical(
        tmp_path: Path, shm: Path, source: str,
        reference: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, ref = reference
    tier0 = ["--tier0", str(shm / "t0")] if source == "tier0" else []
    rows = _train(tmp_path, "kill", "--kill-at", "10", *tier0, restarts=1)  # saved: 9, 12
    assert [(r["attempt"], r["step"]) for r in rows] == (
        [(0, s) for s in range(1, 11)] + [(1, s) for s in range(10, 17)])
    assert _restored(tmp_path, "kill") == [{"attempt": 1, "step": 9, "source": source}]
    _assert_same_as(ref, rows)  # loss bits (dropout: the RNG streams), LR, tokens seen
    assert ref[16]["loss_hex"] != ref[1]["loss_hex"]


@pytest.mark.slow
def test_resume_from_tier2_alone(tmp_path: Path,
                                 reference: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, ref = reference
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    tier2 = ["--tier2", bucket.as_uri()]
    first = _train(tmp_path, "t2", *tier2, "--stop-after", "9")  # close() drains the upload
    assert [r["step"] for r in first] == list(range(1, 10))
    assert (bucket / "step-00000009" / "COMPLETE").is_file()
    shutil.rmtree(tmp_path / "t2")  # the node is gone: tier 1 is empty
    rows = _train(tmp_path, "t2", *tier2)
    assert _restored(tmp_path, "t2") == [{"attempt": 0, "step": 9, "source": "tier2"}]
    assert [r["step"] for r in rows] == list(range(1, 17))
    _assert_same_as(ref, rows)


def test_checkpoint_loads_with_plain_dcp(
        reference: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    from tests.integrations.titan_train import model_fn

    tmp, _ = reference
    model = model_fn()
    sd = {"model": model.state_dict()}  # torchtitan's canonical FQNs, under "model"
    dcp.load(sd, checkpoint_id=tmp / "ref" / "step-00000016")  # no tierckpt involved
    final = torch.load(tmp / "final.pt", weights_only=True)
    assert sd["model"].keys() == final.keys()
    for key, value in final.items():
        assert torch.equal(sd["model"][key], value), key


@pytest.mark.slow
def test_import_tierckpt_never_imports_torchtitan(imported_by_tierckpt: frozenset[str]) -> None:
    assert "torchtitan" not in imported_by_tierckpt


# -- one process, no process group --------------------------------------------------------
def _job(tier1: Path, *, dp_world_size: int = 1, stock: bool = False,
         **knobs: Any) -> SimpleNamespace:
    """The pieces torchtitan's Trainer hands its checkpointer, and the checkpointer."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from tests.integrations.titan_train import Tokens, TrainCounters, model_fn
    from tierckpt.integrations.torchtitan import tierckpt_config

    model = model_fn()
    optimizers = dataclasses.replace(default_adamw(lr=1e-2), implementation="for-loop"
                                     ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=20)
    loader = ParallelAwareDataloader(Tokens(seed=1, dp_rank=0), dp_rank=0,
                                     dp_world_size=dp_world_size, batch_size=2,
                                     generator=torch.Generator())
    counters = TrainCounters()
    config = (CheckpointManager.Config(enable=True, folder=str(tier1), keep_latest_k=0, **knobs)
              if stock else tierckpt_config(**{"enable": True, "tier1": str(tier1), **knobs}))
    ckpt = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                        lr_schedulers=lr_schedulers, states={"train_state": counters},
                        sd_adapter=None)
    return SimpleNamespace(model=model, optimizers=optimizers, lr_schedulers=lr_schedulers,
                           loader=loader, counters=counters, ckpt=ckpt, batches=iter(loader))


def _step(job: SimpleNamespace) -> None:
    job.counters.step += 1
    job.optimizers.zero_grad()
    inputs, labels = next(job.batches)
    job.counters.ntokens_seen += labels.numel()
    loss = F.cross_entropy(job.model(inputs["input"]).flatten(0, 1), labels.flatten())
    loss.backward()
    job.ckpt.maybe_wait_for_staging()
    job.optimizers.step()
    job.lr_schedulers.step()
    job.ckpt.save(job.counters.step)


def _snapshot(job: SimpleNamespace) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in job.model.state_dict().items()},
            "optim": {k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in job.optimizers.state_dict().items()},
            "lr": job.lr_schedulers.schedulers[0].get_last_lr(),
            "counters": job.counters.state_dict()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_round_trip_restores_every_piece(tmp_path: Path) -> None:
    job = _job(tmp_path / "t1", interval=4)
    with job.ckpt:
        for _ in range(4):
            _step(job)  # step 4 is saved
        saved, rng = _snapshot(job), torch.get_rng_state()
        upcoming = [next(job.batches)[1] for _ in range(2)]
        for _ in range(3):
            _step(job)  # train on past the save: everything changes
        assert job.ckpt.load() is True
        assert job.ckpt.restored is not None and job.ckpt.restored.step == 4
        now = _snapshot(job)
    assert _same(now["model"], saved["model"]) and _same(now["optim"], saved["optim"])
    assert now["lr"] == saved["lr"] and now["counters"] == {"step": 4, "ntokens_seen": 128}
    assert torch.equal(torch.get_rng_state(), rng)
    batches = iter(job.loader)  # a new iterator starts where the save was
    assert all(torch.equal(next(batches)[1], want) for want in upcoming)


def test_exclude_from_loading_keeps_the_live_pieces(tmp_path: Path) -> None:
    job = _job(tmp_path / "t1", interval=4,
               exclude_from_loading=["optimizer", "lr_scheduler", "dataloader"])
    with job.ckpt:
        for _ in range(4):
            _step(job)
        saved = _snapshot(job)
        for _ in range(2):
            _step(job)
        live, position = _snapshot(job), job.loader.dataset.sample_idx
        assert job.ckpt.load() is True
        now = _snapshot(job)
    assert _same(now["model"], saved["model"]) and now["counters"] == saved["counters"]
    assert _same(now["optim"], live["optim"]) and now["lr"] == live["lr"]
    assert job.loader.dataset.sample_idx == position == 12  # not back at step 4's 8


def test_a_changed_dp_layout_is_refused_unless_the_loader_is_excluded(tmp_path: Path) -> None:
    from tierckpt.errors import StateMismatchError

    job = _job(tmp_path / "t1", interval=2)
    with job.ckpt:
        _step(job)
        _step(job)
    job = _job(tmp_path / "t1", dp_world_size=2)
    with job.ckpt, pytest.raises(StateMismatchError, match="exclude_from_loading"):
        job.ckpt.load()
    job = _job(tmp_path / "t1", dp_world_size=2, exclude_from_loading=["dataloader"])
    with job.ckpt:
        assert job.ckpt.load() is True and job.counters.step == 2


def test_a_fresh_start_loads_a_stock_initial_load_path(tmp_path: Path) -> None:
    stock = _job(tmp_path / "stock", stock=True, interval=100, last_save_model_only=True)
    for _ in range(3):
        _step(stock)
    stock.ckpt.save(3, last_step=True)  # torchtitan's model-only export, its own format
    stock.ckpt.close()
    want = {k: v.clone() for k, v in stock.model.state_dict().items()}
    job = _job(tmp_path / "t1", interval=1,
               initial_load_path=str(tmp_path / "stock" / "step-3"))
    with job.ckpt:
        assert job.ckpt.load() is True and job.ckpt.restored is None
        assert _same(job.model.state_dict(), want) and job.counters.step == 0
        _step(job)  # and it saves on from step 1, in tierckpt's format
    assert (tmp_path / "t1" / "step-00000001" / "COMPLETE").is_file()


def test_a_disabled_manager_does_nothing(tmp_path: Path) -> None:
    job = _job(tmp_path / "t1", enable=False)
    assert job.ckpt.load() is False and job.ckpt.save(1, last_step=True) is False
    job.ckpt.maybe_wait_for_staging()
    job.ckpt.close()
    assert not (tmp_path / "t1").exists()


def test_close_while_an_exception_is_handled_does_not_raise_over_it(tmp_path: Path) -> None:
    job = _job(tmp_path / "t1", interval=1)
    _step(job)
    with pytest.raises(RuntimeError, match="training failed"):
        try:
            raise RuntimeError("training failed")
        except RuntimeError:
            job.ckpt.close()  # what torchtitan's train.py does in its except block
            raise
    assert (tmp_path / "t1" / "step-00000001" / "COMPLETE").is_file()
    job.ckpt.close()  # idempotent


def test_save_due_is_the_stock_rule() -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from tierckpt.integrations.torchtitan import save_due

    for interval in (1, 3, 5):
        for first in (False, True):
            stock = SimpleNamespace(enable=True, load_only=False, interval=interval,
                                    enable_first_step_checkpoint=first)
            for step in range(1, 12):
                for last in (False, True):
                    assert save_due(step, last_step=last, first_step=first,
                                    interval=interval) == \
                        CheckpointManager._should_save(stock, step, last), (interval, step)
    assert save_due(7, last_step=False, first_step=False, interval=None, auto=True)
    assert not save_due(6, last_step=False, first_step=False, interval=None, auto=False)


@pytest.mark.parametrize(("knobs", "match"), [
    ({"last_save_model_only": True}, "tierckpt export"),
    ({"create_seed_checkpoint": True}, "initial_load_path"),
    ({"load_step": 5}, "newest complete"),
    ({"exclude_from_loading": ["train_state"]}, "steps must increase"),
    ({"folder": "s3://bucket/ckpt"}, "node-local"),
    ({"tier2": "ftp://host/x"}, "tier2"),
    ({"verify": "most"}, "verify"),
    ({"upload_every": 0}, "upload_every"),
    ({"node_mtbf": "soon"}, "node_mtbf"),
])
def test_refused_settings_fail_when_the_config_is_built(knobs: dict[str, Any],
                                                        match: str) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.torchtitan import tierckpt_config

    with pytest.raises(ConfigError, match=match):
        tierckpt_config(enable=True, **knobs)


def test_refused_pieces_fail_when_the_manager_is_built(tmp_path: Path) -> None:
    from tierckpt.errors import ConfigError

    with pytest.raises(ConfigError, match=r"exclude_from_loading names \['ema'\]"):
        _job(tmp_path / "t1", exclude_from_loading=["ema"])
    assert not (tmp_path / "t1").exists()  # refused before anything touched tier 1


def test_a_state_that_is_not_plain_is_refused(tmp_path: Path) -> None:
    from torchtitan.components.optimizer import default_adamw

    from tests.integrations.titan_train import model_fn
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.torchtitan import tierckpt_config

    class Opaque:
        def state_dict(self) -> dict[str, Any]:
            return {"thing": SimpleNamespace()}

    model = model_fn()
    optimizers = dataclasses.replace(default_adamw(), implementation="for-loop").build(
        model_parts=[model])
    with pytest.raises(ConfigError, match=r"states\['ema'\]"):
        tierckpt_config(enable=True, tier1=str(tmp_path / "t1")).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
            states={"ema": Opaque()}, sd_adapter=None)


# -- torchtitan's command line ------------------------------------------------------------
REGISTRY = ["--module", "tests.integrations.titan_configs", "--config", "tierckpt"]
ADDED = {"tier1", "tier2", "upload_every", "tier2_keep_last", "tier0", "tier1_every",
         "verify", "node_mtbf", "collective_timeout_s", "upload_drain_s"}


def test_torchtitans_cli_selects_and_sets_it(tmp_path: Path) -> None:
    from torchtitan.config import ConfigManager

    from tierckpt.integrations.torchtitan import TierckptCheckpointManager
    from tierckpt.policy.interval import AutoInterval

    cfg: Any = ConfigManager().parse_args([
        *REGISTRY, "--checkpoint.tier2", tmp_path.as_uri(), "--checkpoint.upload-every", "2",
        "--checkpoint.node_mtbf", "30d", "--checkpoint.keep_latest_k", "4"])
    ck = cfg.checkpoint
    assert type(ck) is TierckptCheckpointManager.Config and ck.enable
    assert (ck.interval, ck.keep_latest_k) == (10, 4)  # the stock config's, and the flag's
    mc = ck.manager_config(cfg.dump_folder)
    assert mc.tier1 == Path("./outputs/checkpoint").absolute()
    assert mc.tier2 is not None
    assert (mc.tier2.url, mc.tier2.upload_every, mc.keep_last) == (tmp_path.as_uri(), 2, 4)
    assert isinstance(mc.interval, AutoInterval)


def test_torchtitans_cli_reports_a_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    from torchtitan.config import ConfigManager

    with pytest.raises(SystemExit):
        ConfigManager().parse_args([*REGISTRY, "--checkpoint.last_save_model_only"])
    assert "tierckpt export" in capsys.readouterr().err


def test_the_added_flags_are_frozen() -> None:
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from tierckpt.integrations.torchtitan import TierckptCheckpointManager

    ours = {f.name for f in dataclasses.fields(TierckptCheckpointManager.Config)}
    base = {f.name for f in dataclasses.fields(BaseCheckpointManager.Config)}
    assert ours - base == ADDED and base <= ours  # a rename or removal is a decision
