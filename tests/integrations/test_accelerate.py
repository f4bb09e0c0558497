"""``tierckpt.integrations.accelerate`` with real Accelerate (1.15) on CPU.

Two-rank jobs (DDP over gloo, torchrun) run ``accel_train.py``: an uninterrupted run is the
reference; a run SIGKILLed twice (a mid-epoch resume point, then one on an epoch's last
batch) and restarted by torchrun, and a run resumed from tier 2 alone, must log the same
bits for every step. The reference's checkpoint loads with plain ``dcp.load``. In-process
tests (one process, no process group) cover the round trip of every accelerator value and
each refusal.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests._launch import torchrun
from tests._require import require
from tests.integrations import _runs as runs

JOB = Path(__file__).parent / "accel_train.py"
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
COMPARED = ("loss_hex", "lr", "idx", "epoch", "acc_step", "samples")  # all but "attempt"


@pytest.fixture(autouse=True)
def _needs_accelerate() -> None:
    require(HAVE_ACCELERATE and importlib.util.find_spec("torchdata") is not None,
            "accelerate and torchdata are not installed: pip install 'tierckpt[accelerate,data]'")


def _train(tmp: Path, name: str, *args: str, restarts: int = 0) -> list[dict[str, Any]]:
    return runs.train(JOB, tmp, name, *args, restarts=restarts)


_restored = runs.restored


def _assert_same_as(ref: dict[int, dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    runs.assert_same_as(ref, rows, COMPARED)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("accel-ref")
    rows = _train(tmp, "ref", "--weights-out", str(tmp / "final.pt"))
    assert [r["step"] for r in rows] == list(range(20))
    assert _restored(tmp, "ref") == []  # a fresh start: nothing to restore
    return tmp, {r["step"]: r for r in rows}


# -- two ranks, torchrun ------------------------------------------------------------------
@pytest.mark.slow
def test_killed_twice_resumes_bit_identical(
        tmp_path: Path, reference: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, ref = reference
    # saves after steps 2, 5, 8, 11, ... (every=3); an epoch is 4 optimizer steps (64
    # samples, 2 ranks x batch 4, 2 micro-batches per step): step 8 is mid-epoch, 11 ends one
    rows = _train(tmp_path, "kill", "--kill-at", "9,13", "--kill-rank", "1,0", restarts=2)
    assert [(r["attempt"], r["step"]) for r in rows] == (
        [(0, s) for s in range(10)] + [(1, s) for s in range(9, 14)]
        + [(2, s) for s in range(12, 20)])
    assert [(r["step"], r["source"]) for r in _restored(tmp_path, "kill")] == [
        (8, "tier1"), (11, "tier1")]
    _assert_same_as(ref, rows)  # losses, lr, samples, epoch, accelerator.step: every bit
    assert rows[-1]["epoch"] == 4 and ref[19]["loss_hex"] != ref[0]["loss_hex"]


@pytest.mark.slow
def test_resume_from_tier2_alone(tmp_path: Path,
                                 reference: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, ref = reference
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    tier2 = ["--tier2", bucket.as_uri()]
    first = _train(tmp_path, "t2", *tier2, "--stop-after", "8")  # close() drains the upload
    assert [r["step"] for r in first] == list(range(9))
    assert (bucket / "step-00000008" / "COMPLETE").is_file()
    shutil.rmtree(tmp_path / "t2")  # the node is gone: tier 1 is empty
    rows = _train(tmp_path, "t2", *tier2)
    assert _restored(tmp_path, "t2") == [{"attempt": 0, "step": 8, "source": "tier2"}]
    assert [r["step"] for r in rows] == list(range(9)) + list(range(9, 20))
    _assert_same_as(ref, rows)


@pytest.mark.slow
def test_checkpoint_loads_with_plain_dcp(
        reference: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    from tests.integrations.accel_train import model_fn

    tmp, _ = reference
    model = model_fn()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=tmp / "ref" / "step-00000019")  # no tierckpt involved
    final = torch.load(tmp / "final.pt", weights_only=True)
    assert sd["model"].keys() == final.keys()
    for key, value in final.items():
        assert torch.equal(sd["model"][key], value), key


@pytest.mark.slow  # ~10-15 s of process start-up for one refusal
def test_refuses_a_process_group_accelerate_does_not_see(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("with a GPU, Accelerate without cpu=True is a (1-GPU) multi-GPU job")
    # without cpu=True on a machine with no GPU, Accelerate runs each rank on its own
    proc = torchrun(JOB, "--tier1", str(tmp_path / "t1"), "--losses", str(tmp_path / "l"),
                    "--no-cpu", check=False)
    assert proc.returncode != 0
    assert "Accelerator(cpu=True)" in proc.stderr
    assert not (tmp_path / "t1").exists() or not any((tmp_path / "t1").glob("step-*"))


@pytest.mark.slow
def test_import_tierckpt_never_imports_accelerate(imported_by_tierckpt: frozenset[str]) -> None:
    assert "accelerate" not in imported_by_tierckpt


# -- one process, in-process Accelerate -----------------------------------------------------
class Counter:
    """A registered object with plain state."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


class Opaque:
    """A registered object whose state is an arbitrary class: not loadable weights_only."""

    def state_dict(self) -> dict[str, Any]:
        return {"thing": Counter()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.fixture
def fresh() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerator(stateful: bool = True, seedable: bool = True, accum: int = 1) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    return Accelerator(cpu=True, gradient_accumulation_steps=accum,
                       dataloader_config=DataLoaderConfiguration(
                           use_stateful_dataloader=stateful, use_seedable_sampler=seedable,
                           data_seed=3))


def _objects(generator: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader,
                                              Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)), torch.arange(24))
    loader = DataLoader(data, batch_size=4, shuffle=True,
                        generator=torch.Generator() if generator else None)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return model, opt, loader, sched


def _endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _step(acc: Any, model: nn.Module, opt: Any, sched: Any, batch: Any) -> None:
    x, y, _ = batch
    with acc.accumulate(model):
        acc.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()


def test_round_trip_restores_every_accelerator_value(tmp_path: Path, fresh: None) -> None:
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator()
    model, opt, loader, sched = acc.prepare(*_objects())
    counter = Counter()
    acc.register_for_checkpointing(counter)
    acc.project_configuration.iteration = 4
    with CheckpointManager(acc, tier1=tmp_path / "t1") as ckpt:
        it = _endless(loader)
        for _ in range(8):  # an epoch is 6 batches: this is epoch 1, batch 2
            _step(acc, model, opt, sched, next(it))
            counter.seen += 1
        ckpt.save(7).wait()
        saved_step = acc.step
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        lr, rng = sched.get_last_lr(), torch.get_rng_state()
        upcoming = [next(it)[2].tolist() for _ in range(3)]
        for _ in range(3):  # train on past the save, then change what the save holds
            _step(acc, model, opt, sched, next(it))
        counter.seen, acc.step, acc.project_configuration.iteration = -1, 99, 0
        info = ckpt.restore()
    assert info is not None and info.step == 7
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert (counter.seen, acc.project_configuration.iteration) == (8, 4)
    assert acc.step == saved_step and sched.get_last_lr() == lr
    assert torch.equal(torch.get_rng_state(), rng)
    assert loader.iteration == 1
    it = _endless(loader)  # a new iterator starts where the save was
    assert [next(it)[2].tolist() for _ in range(3)] == upcoming


def test_saves_derive_the_state_dict_keys_once(tmp_path: Path, fresh: None) -> None:
    # the integration hands TrainState the torch optimizer inside Accelerate's wrapper and
    # keeps one TrainState: its StateCapture runs get_state_dict for the first save only
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator()
    model, opt, loader, sched = acc.prepare(*_objects())
    with CheckpointManager(acc, tier1=tmp_path / "t1") as ckpt:
        it = _endless(loader)
        for step in range(3):
            _step(acc, model, opt, sched, next(it))
            ckpt.save(step).wait()
        capture = ckpt.state.model_state.capture
    assert ckpt.state.optimizer is opt.optimizer
    assert (capture.calls, capture.reference_calls) == (3, 1)


def test_manual_data_position_saves_no_loader(tmp_path: Path, fresh: None) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator(stateful=False)
    acc.prepare(*_objects())
    with pytest.raises(ConfigError, match="use_stateful_dataloader=True"):
        CheckpointManager(acc, tier1=tmp_path / "t1")
    with CheckpointManager(acc, tier1=tmp_path / "t1", data_position="manual") as ckpt:
        assert ckpt.state.dataloader is None
        ckpt.save(0).wait()
        assert ckpt.restore() is not None


def test_refuses_a_shuffle_without_seedable_sampler(tmp_path: Path, fresh: None) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator(seedable=False)
    acc.prepare(*_objects())
    with pytest.raises(ConfigError, match="use_seedable_sampler=True"):
        CheckpointManager(acc, tier1=tmp_path / "t1")


def test_warns_about_a_loader_without_generator(tmp_path: Path, fresh: None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator()
    acc.prepare(*_objects(generator=False))
    with caplog.at_level(logging.WARNING, logger="tierckpt"), \
            CheckpointManager(acc, tier1=tmp_path / "t1"):
        pass
    assert "has no generator" in caplog.text


def test_refuses_a_registered_object_that_is_not_plain(tmp_path: Path, fresh: None) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator()
    acc.prepare(*_objects())
    acc.register_for_checkpointing(Counter(), Opaque())
    with pytest.raises(ConfigError, match=r"registered object 1 \(Opaque\)"):
        CheckpointManager(acc, tier1=tmp_path / "t1")
    assert not (tmp_path / "t1").exists()  # refused before anything touched tier 1


def test_refuses_two_models(tmp_path: Path, fresh: None) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator()
    model, opt, loader, sched = _objects()
    acc.prepare(model, opt, loader, sched, nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="exactly one model"):
        CheckpointManager(acc, tier1=tmp_path / "t1")


def test_refuses_a_save_inside_an_accumulation_window(tmp_path: Path, fresh: None) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator(accum=2)
    model, opt, loader, sched = acc.prepare(*_objects())
    with CheckpointManager(acc, tier1=tmp_path / "t1") as ckpt:
        it = iter(loader)
        _step(acc, model, opt, sched, next(it))  # 1 of 2 micro-batches
        with pytest.raises(ConfigError, match="gradient-accumulation window"):
            ckpt.save(0)
        _step(acc, model, opt, sched, next(it))
        ckpt.save(0).wait()


def test_refuses_objects_prepared_after_it(tmp_path: Path, fresh: None) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator()
    _, opt, _, _ = acc.prepare(*_objects())
    with CheckpointManager(acc, tier1=tmp_path / "t1") as ckpt:
        acc.prepare(torch.optim.lr_scheduler.StepLR(opt, 3))
        with pytest.raises(ConfigError, match="after CheckpointManager"):
            ckpt.save(0)


def test_every_and_interval_are_exclusive(tmp_path: Path, fresh: None) -> None:
    import tierckpt
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.accelerate import CheckpointManager

    acc = _accelerator()
    acc.prepare(*_objects())
    with pytest.raises(ConfigError, match="not both"):
        CheckpointManager(acc, tier1=tmp_path / "t1", every=5,
                          interval=tierckpt.Every(steps=5))
    with pytest.raises(ConfigError, match=r"accelerate\.Accelerator"):
        CheckpointManager(object(), tier1=tmp_path / "t1")  # type: ignore[arg-type]


def _documented_loop(tier1: Path, mode: str, stop: int | None) -> list[tuple[int, str, list[int]]]:
    """The loop of docs/integrations/accelerate.md (its ``stateful`` or ``manual`` form), as
    a fresh process would run it: (step, loss bits, sample ids) per optimizer step."""
    from accelerate.state import AcceleratorState, GradientState

    from tierckpt.integrations.accelerate import CheckpointManager

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accum, num_epochs, rows = 2, 4, []
    acc = _accelerator(stateful=mode == "stateful", accum=accum)
    model, opt, loader, sched = acc.prepare(*_objects())
    torch.manual_seed(1)  # the dropout stream
    with CheckpointManager(acc, tier1=tier1, every=2, data_position=mode) as ckpt:
        restored = ckpt.restore()
        step = restored.step + 1 if restored else 0
        first_epoch, skip = divmod(step * accum, len(loader))
        for epoch in range(loader.iteration if mode == "stateful" else first_epoch, num_epochs):
            batches = loader
            if mode == "manual":
                loader.set_epoch(epoch)
                if epoch == first_epoch:
                    batches = acc.skip_first_batches(loader, skip)
            ids: list[int] = []
            for x, y, i in batches:
                with acc.accumulate(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    acc.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                ids += i.tolist()
                if acc.sync_gradients:
                    rows.append((step, loss.item().hex(), ids))
                    ids = []
                    if ckpt.should_save(step):
                        ckpt.save(step)
                    if step == stop:
                        return rows
                    step += 1
    return rows


@pytest.mark.parametrize(("mode", "stop"), [  # 3 steps an epoch
    ("stateful", 5),  # the save is on the last batch of epoch 1: resume into epoch 2
    ("manual", 7),    # mid-epoch: skip_first_batches skips one step's 2 batches
])
def test_the_documented_loops_resume_exactly(tmp_path: Path, fresh: None, mode: str,
                                             stop: int) -> None:
    ref = _documented_loop(tmp_path / "ref", mode, None)
    assert [r[0] for r in ref] == list(range(12))
    first = _documented_loop(tmp_path / "run", mode, stop)
    resumed = _documented_loop(tmp_path / "run", mode, None)
    assert [r[0] for r in resumed] == list(range(stop + 1, 12))
    assert first + resumed == ref
