"""tierckpt inside Hugging Face Accelerate (1.15): ``CheckpointManager(accelerator, ...)``.

Importing this module imports Accelerate; ``import tierckpt`` never does.

It replaces ``accelerator.save_state``/``load_state`` (synchronous, one directory of
``torch.save`` files per checkpoint, no commit marker, no verification, no second tier)
with :class:`tierckpt.CheckpointManager`. What the accelerator has been given by
``prepare()`` and ``register_for_checkpointing()`` is mapped onto one
:class:`tierckpt.TrainState`::

    accelerator._models[0]          -> TrainState.model       (plain, DDP, FSDP2: via DCP)
    accelerator._optimizers[0]      -> TrainState.optimizer   (the wrapped torch optimizer)
    accelerator._schedulers         -> TrainState.scheduler   (_Schedulers: all of them)
    accelerator._dataloaders        -> TrainState.dataloader  (_Loaders: position + epoch)
    accelerator.step, .scaler,      -> TrainState.extra["accelerate"] (plain values, per rank)
      project_configuration.iteration,
      _custom_objects' state_dict()
    every RNG stream of every rank  -> TrainState's own capture (python, numpy, torch, CUDA)

``save(step)`` blocks only while the state is staged into host memory; the write, the
commit and the promotion to tier 2 run in the background (one save in flight; its error
surfaces at the next ``save()``/``wait()``/``close()``). ``restore()`` loads the newest
complete, verified checkpoint on tier 1 or tier 2 and puts the accelerator's counters and
registered objects back.

What it refuses, at construction (every rank, before training starts), with the fix in the
message: DeepSpeed, Megatron-LM and XLA (their engines own the state) and FSDP1 (use
``fsdp_version=2``); more than one prepared model or optimizer; a process group Accelerate
does not know about (``cpu=True`` forgotten on a machine without GPUs: each rank would
train alone); with ``data_position="stateful"`` (the default) a prepared data loader that
cannot resume its position exactly; a registered object whose ``state_dict()`` does not
load with ``weights_only=True``. At ``save()``: a save inside a gradient-accumulation
window (its gradients are in no checkpoint), and objects prepared or registered after
construction.

One thing it saves that ``save_state`` does not: the epoch of each prepared loader
(``DataLoaderShard.iteration``, from which Accelerate seeds each epoch's order). Without
it a run resumed in epoch 1 or later replays epoch 0's order (seen with Accelerate 1.15's
own ``save_state``/``load_state``; docs/integrations/accelerate.md).

This is one module, not a package: the adapters below exist only to give TrainState's
single scheduler and loader slots the lists Accelerate keeps.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any

try:
    import accelerate
    from accelerate.data_loader import SeedableRandomSampler, get_sampler
    from accelerate.utils import DistributedType
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tierckpt.integrations.accelerate needs Hugging Face Accelerate: "
                      "pip install 'tierckpt[accelerate]'") from e
import torch
import torch.distributed as dist
from torch.utils.data import RandomSampler

from tierckpt.errors import ConfigError, StateMismatchError
from tierckpt.integrations._plain import require_plain
from tierckpt.manager import CheckpointManager as _Manager
from tierckpt.policy.interval import Every
from tierckpt.restore.loader import RestoreInfo
from tierckpt.save.saver import SaveHandle, SaveResult
from tierckpt.state import TrainState

__all__ = ["EXTRA_KEY", "CheckpointManager", "DataPosition"]

_log = logging.getLogger("tierckpt")

EXTRA_KEY = "accelerate"
"""Where the accelerator's own values live in ``TrainState.extra``."""

_ENGINES = {  # distributed types whose engine keeps model and optimizer out of DCP's reach
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}


class DataPosition(str, enum.Enum):
    """How a resumed run finds its place in the data.

    ``STATEFUL`` (default): every prepared data loader is a ``StatefulDataLoader``
    (``DataLoaderConfiguration(use_stateful_dataloader=True)``); its position and epoch
    are saved per rank and a restored run continues with the next batch. ``MANUAL``:
    loaders are not saved; the loop skips to its place itself with
    ``accelerator.skip_first_batches`` (docs/integrations/accelerate.md).
    """

    STATEFUL = "stateful"
    MANUAL = "manual"


class CheckpointManager:
    """tierckpt's :class:`~tierckpt.CheckpointManager` for an ``accelerate.Accelerator``.

    Construct it on every process after ``accelerator.prepare(...)`` and
    ``register_for_checkpointing(...)``; it is collective, like every method. ``every``:
    save every N steps (``should_save``); ``data_position``: see :class:`DataPosition`;
    every other keyword goes to :class:`tierckpt.ManagerConfig` (``tier1`` is required;
    ``tier2``, ``keep_last``, ``interval``, ...). Use it as a context manager or call
    :meth:`close`.
    """

    def __init__(self, accelerator: accelerate.Accelerator, *, every: int | None = None,
                 data_position: DataPosition | str = DataPosition.STATEFUL,
                 **kwargs: Any) -> None:
        if not isinstance(accelerator, accelerate.Accelerator):
            raise ConfigError(f"CheckpointManager(accelerator) needs an accelerate.Accelerator, "
                              f"got {type(accelerator).__name__}")
        try:
            self.data_position = DataPosition(data_position)
        except ValueError:
            raise ConfigError(f"data_position must be one of {[p.value for p in DataPosition]}, "
                              f"got {data_position!r}") from None
        if every is not None:
            if "interval" in kwargs or "config" in kwargs:
                raise ConfigError("pass every=N or interval=/config=, not both")
            kwargs["interval"] = Every(steps=every)
        self.accelerator = accelerator
        _check_accelerator(accelerator)
        self._prepared = _prepared(accelerator)
        loaders = list(accelerator._dataloaders)
        if loaders and self.data_position is DataPosition.STATEFUL:
            _check_loaders(loaders)
        self.state = TrainState(
            model=accelerator._models[0], optimizer=_unwrap(accelerator._optimizers),
            scheduler=_Schedulers(accelerator._schedulers) if accelerator._schedulers else None,
            dataloader=(_Loaders(loaders) if loaders and
                        self.data_position is DataPosition.STATEFUL else None),
            extra={})
        self._accelerator_values()  # a registered object that is not plain fails now
        self.manager = _Manager(**kwargs)

    # -- public API -----------------------------------------------------------------------
    def save(self, step: int) -> SaveHandle:
        """Save everything the accelerator was prepared with after optimizer step ``step``
        (see :meth:`tierckpt.CheckpointManager.save`: blocks only while staging). Call it
        where gradients were just synchronised (``accelerator.sync_gradients``)."""
        self._check_unchanged()
        if not self.accelerator.sync_gradients:
            raise ConfigError(
                f"save(step={step}) inside a gradient-accumulation window "
                f"(accelerator.step={self.accelerator.step}, "
                f"gradient_accumulation_steps={self.accelerator.gradient_accumulation_steps}): "
                "the accumulated gradients are in no checkpoint, so a resume would differ; "
                "save when accelerator.sync_gradients is True (after the optimizer step)")
        self.state.extra = {EXTRA_KEY: self._accelerator_values()}
        return self.manager.save(step, self.state)

    def restore(self) -> RestoreInfo | None:
        """Load the newest complete, verified checkpoint on tier 1 or tier 2 into the prepared
        objects, every RNG stream, the data loaders, ``accelerator.step`` and the registered
        objects (see :meth:`tierckpt.CheckpointManager.restore`). None on a fresh start.
        Call it before the first batch is drawn: creating a loader's iterator is where a
        resumed epoch picks up its position and epoch."""
        self._check_unchanged()
        extra: dict[str, Any] = {}
        self.state.extra = extra
        info = self.manager.restore(self.state)
        if info is None:
            return None
        values = extra.get(EXTRA_KEY)
        if not isinstance(values, dict):
            raise StateMismatchError(
                f"step {info.step} ({info.path}) was not saved by "
                "tierckpt.integrations.accelerate (no accelerator values in it); model, "
                "optimizer and RNG were loaded, the accelerator's counters were not")
        self._apply_accelerator_values(values, info)
        return info

    def should_save(self, step: int) -> bool:
        """Whether to save after ``step`` (``every=`` or ``interval=``)."""
        return self.manager.should_save(step)

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the in-flight save is committed; raise its error."""
        return self.manager.wait(timeout)

    def close(self, *, after_error: bool = False) -> None:
        """Wait for the in-flight save, stop the uploader (after draining what is due),
        release tier 1. Idempotent; raises the in-flight save's error. ``after_error``:
        see :meth:`tierckpt.CheckpointManager.close`."""
        self.manager.close(after_error=after_error)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.manager.__exit__(exc_type, exc, tb)

    # -- internals ------------------------------------------------------------------------
    def _accelerator_values(self) -> dict[str, Any]:
        """The accelerator's own state as plain values, checked to load with
        ``weights_only=True`` now rather than first at a restart."""
        acc = self.accelerator
        custom = []
        for i, obj in enumerate(acc._custom_objects):
            what = f"registered object {i} ({type(obj).__name__}).state_dict()"
            custom.append(require_plain(what, obj.state_dict()))
        scaler = acc.scaler.state_dict() if acc.scaler is not None else None
        return {"step": int(acc.step), "save_iteration": int(acc.save_iteration),
                "custom": custom, "scaler": scaler, "version": accelerate.__version__}

    def _apply_accelerator_values(self, values: dict[str, Any], info: RestoreInfo) -> None:
        acc = self.accelerator
        saved, now = values["custom"], acc._custom_objects
        if len(saved) != len(now):
            raise StateMismatchError(
                f"step {info.step} holds {len(saved)} registered object(s), the accelerator "
                f"has {len(now)} (register_for_checkpointing); model, optimizer and RNG were "
                "loaded. Register the same objects in the same order as the saving run")
        for obj, state in zip(now, saved, strict=True):
            obj.load_state_dict(state)
        if acc.scaler is not None and values["scaler"] is not None:
            acc.scaler.load_state_dict(values["scaler"])
        elif (acc.scaler is None) != (values["scaler"] is None):
            _log.warning("step %d was saved %s a GradScaler and this run has %s; its loss "
                         "scale starts afresh", info.step,
                         "with" if values["scaler"] is not None else "without",
                         "one" if acc.scaler is not None else "none")
        acc.step = int(values["step"])
        acc.project_configuration.iteration = int(values["save_iteration"])

    def _check_unchanged(self) -> None:
        if _prepared(self.accelerator) != self._prepared:
            raise ConfigError(
                "accelerator.prepare() or register_for_checkpointing() was called after "
                "CheckpointManager(accelerator) was built, so the new objects would be in no "
                "checkpoint; build the manager after preparing and registering everything")


# -- checks -------------------------------------------------------------------------------
def _check_accelerator(acc: accelerate.Accelerator) -> None:
    engine = _ENGINES.get(acc.distributed_type)
    if engine is not None:
        raise ConfigError(
            f"{engine} keeps the model and optimizer state inside its own engine, out of "
            "torch.distributed.checkpoint's reach; use accelerator.save_state with it, or "
            "train with DDP or FSDP2")
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise ConfigError(
            "FSDP1 hands out ShardedTensor state, which tierckpt does not checkpoint; use "
            "FullyShardedDataParallelPlugin(fsdp_version=2) (DTensor shards through DCP)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != acc.num_processes:
        raise ConfigError(
            f"the process group has {world} ranks but Accelerate runs "
            f"num_processes={acc.num_processes} ({acc.distributed_type.value}): every rank "
            "would train its own model on all the data. On a machine without GPUs pass "
            "Accelerator(cpu=True) (accelerate launch --cpu)")
    if len(acc._models) != 1 or len(acc._optimizers) > 1:
        raise ConfigError(
            f"the accelerator was prepared with {len(acc._models)} model(s) and "
            f"{len(acc._optimizers)} optimizer(s); tierckpt's Accelerate integration saves "
            "exactly one model and at most one optimizer. Put several modules into one "
            "nn.Module (e.g. nn.ModuleDict) with one optimizer before accelerator.prepare, or "
            "build a tierckpt.TrainState yourself")


def _check_loaders(loaders: Sequence[Any]) -> None:
    """Refuse a prepared loader whose position cannot be restored exactly; warn about one
    whose iterator draws from the global RNG."""
    for i, dl in enumerate(loaders):
        if not getattr(dl, "use_stateful_dataloader", False):
            raise ConfigError(
                f"prepared data loader {i} is not stateful, so its position cannot be saved: "
                "pass Accelerator(dataloader_config=DataLoaderConfiguration("
                "use_stateful_dataloader=True, use_seedable_sampler=True)) (needs torchdata), "
                "or CheckpointManager(..., data_position='manual') and skip to the position "
                "yourself with accelerator.skip_first_batches")
        sampler = get_sampler(dl)
        if isinstance(sampler, RandomSampler) and not isinstance(sampler,
                                                                 SeedableRandomSampler):
            raise ConfigError(
                f"prepared data loader {i} shuffles with a {type(sampler).__name__} whose "
                "generator state at the start of the epoch nobody saves: the resumed epoch "
                "would be drawn in another order. Pass DataLoaderConfiguration("
                "use_stateful_dataloader=True, use_seedable_sampler=True): each epoch's order "
                "is then a function of the seed and the epoch, which is saved")
        if getattr(dl, "generator", None) is None:
            _log.warning(
                "prepared data loader %d has no generator: creating its iterator after "
                "restore() draws from the global torch RNG, which shifts dropout and every "
                "other random stream of the resumed run. Give the DataLoader "
                "generator=torch.Generator() before accelerator.prepare for exact resumes", i)


def _prepared(acc: accelerate.Accelerator) -> tuple[tuple[int, ...], ...]:
    """Identities of everything the accelerator would checkpoint, to notice late additions."""
    return tuple(tuple(id(o) for o in objs) for objs in (
        acc._models, acc._optimizers, acc._schedulers, acc._dataloaders, acc._custom_objects))


def _unwrap(optimizers: Sequence[Any]) -> torch.optim.Optimizer | None:
    """The torch optimizer inside Accelerate's wrapper: DCP reads and writes it directly, so
    the wrapper's step bookkeeping (and its GradScaler patching) is never involved."""
    if not optimizers:
        return None
    return getattr(optimizers[0], "optimizer", optimizers[0])  # type: ignore[no-any-return]


# -- adapters: Accelerate's lists in TrainState's single slots ------------------------------
class _Schedulers:
    """Every prepared LR scheduler as one ``state_dict``/``load_state_dict`` object."""

    def __init__(self, schedulers: Sequence[Any]) -> None:
        self.schedulers = list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [require_plain(f"LR scheduler {i}", s.state_dict())
                               for i, s in enumerate(self.schedulers)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _apply_each("LR scheduler", self.schedulers, state["schedulers"],
                    lambda s, sd: s.load_state_dict(sd))


class _Loaders:
    """Every prepared (stateful) data loader: torchdata's position and Accelerate's epoch.

    Accelerate counts epochs in ``DataLoaderShard.iteration`` (it sets the sampler's epoch
    from it at each ``iter()``) and keeps it out of the loader's ``state_dict``, so it is
    saved here beside it. A save during the epoch's last batch resumes into the next epoch:
    the loader's state says its iterator finished, and Accelerate would count the epoch
    only after that batch.
    """

    def __init__(self, loaders: Sequence[Any]) -> None:
        self.loaders = list(loaders)

    def state_dict(self) -> dict[str, Any]:
        return {"loaders": [{"state": require_plain(f"data loader {i}", dl.state_dict()),
                             "epoch": _resume_epoch(dl)} for i, dl in enumerate(self.loaders)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def apply(dl: Any, saved: dict[str, Any]) -> None:
            dl.load_state_dict(saved["state"])
            dl.set_epoch(int(saved["epoch"]))

        _apply_each("data loader", self.loaders, state["loaders"], apply)


def _resume_epoch(dl: Any) -> int:
    """The epoch (``iteration``) the loader must have when the run resumes after this batch."""
    references = dl.gradient_state.dataloader_references
    in_epoch = any(ref is dl for ref in references)
    return int(dl.iteration) + (1 if in_epoch and dl.end_of_dataloader else 0)


def _apply_each(kind: str, objs: Sequence[Any], saved: Sequence[Any],
                apply: Callable[[Any, Any], None]) -> None:
    if len(saved) != len(objs):
        raise StateMismatchError(
            f"the checkpoint holds {len(saved)} {kind}(s), the accelerator has {len(objs)}; "
            "prepare the same objects as the saving run")
    for obj, state in zip(objs, saved, strict=True):
        apply(obj, state)
