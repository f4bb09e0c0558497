"""tierckpt inside PyTorch Lightning (``pytorch-lightning`` 2.6): a strategy mix-in and a
checkpoint callback. Importing this module imports Lightning; ``import tierckpt`` never does.

Who does what::

    TierckptCheckpoint (a Lightning Checkpoint callback)   when: every N optimizer steps, or
        │  on_train_batch_end, after the optimizer step     CheckpointManager.should_save,
        ▼                                                   and the final step
    trainer.save_checkpoint("tierckpt")                     Lightning builds its checkpoint
        ▼                                                   dict (loops, callbacks, schedulers…)
    TierckptStrategy.save_checkpoint                        model + optimizer: DCP state of a
        ▼                                                   TrainState; the rest: plain values
    CheckpointManager.save(global_step, state)              staged, then written, committed,
                                                            promoted to tier 2 in the background

Resume: ``trainer.fit(model, ckpt_path="tierckpt")`` (:data:`RESUME`). Lightning hands that
path to ``strategy.load_checkpoint`` after the strategy is set up (the model wrapped, the
optimizer built); the strategy restores the newest complete, verified checkpoint on tier 1
or tier 2 into the model, the optimizer and every RNG stream of this rank, and returns the
plain part as Lightning's checkpoint dict, from which Lightning restores its loops (epoch,
global step, batch progress, the position of a stateful data loader), callbacks, LR
schedulers, precision plugin and datamodule. With nothing on any tier it is a fresh start.

The strategy also starts the process group through :func:`tierckpt.init_distributed` under
torchrun (Lightning's plain ``init_process_group`` races on torchrun restarts:
``tierckpt/runtime/distributed.py``), owns the :class:`~tierckpt.CheckpointManager` from
``setup()`` to ``teardown()`` of each ``fit`` (``teardown`` waits for the last save and raises
its error), and leaves every other path (a ``ModelCheckpoint``'s ``.ckpt`` files) to Lightning.

This is one module rather than a package of nouns: strategy and callback are two halves of
one protocol (the callback calls the strategy, the strategy serves Lightning's hooks).

Over the 400-line module budget on purpose: it follows Lightning's strategy and callback
hooks one to one, and splitting them would scatter one framework contract over files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import TorchElasticEnvironment
from pytorch_lightning.callbacks import Checkpoint
from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn

from tierckpt.config import ManagerConfig
from tierckpt.errors import CheckpointError, ConfigError, NoCheckpointError
from tierckpt.format import layout
from tierckpt.integrations._plain import weights_only_problem
from tierckpt.manager import CheckpointManager
from tierckpt.restore.loader import RestoreInfo
from tierckpt.runtime.distributed import DEFAULT_TIMEOUT, init_distributed
from tierckpt.runtime.watchdog import StepWatchdog
from tierckpt.save.saver import SaveHandle
from tierckpt.state import TrainState

__all__ = [
    "RESUME",
    "TierckptCheckpoint",
    "TierckptDDPStrategy",
    "TierckptFSDPStrategy",
    "TierckptModelParallelStrategy",
    "TierckptStrategy",
    "plain_state",
    "resumed_epoch",
]

RESUME = "tierckpt"
"""The ``ckpt_path`` that resumes from tierckpt: ``trainer.fit(model, ckpt_path=RESUME)``.
Also the ``filepath`` of ``trainer.save_checkpoint(RESUME)`` (a save through tierckpt)."""

LIGHTNING_KEY = "lightning"
"""Where Lightning's plain values live in ``TrainState.extra``."""

_DCP_KEYS = ("state_dict", "optimizer_states")  # saved through DCP, never as plain values
_HPARAM_KEYS = (  # read only by load_from_checkpoint, never when fit() resumes
    pl.LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, pl.LightningModule.CHECKPOINT_HYPER_PARAMS_NAME,
    pl.LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE,
    pl.LightningDataModule.CHECKPOINT_HYPER_PARAMS_KEY,
    pl.LightningDataModule.CHECKPOINT_HYPER_PARAMS_NAME,
    pl.LightningDataModule.CHECKPOINT_HYPER_PARAMS_TYPE,
)

_log = logging.getLogger("tierckpt")


def is_resume_path(path: object) -> bool:
    """Whether Lightning's ``ckpt_path``/``filepath`` means tierckpt (:data:`RESUME`)."""
    return isinstance(path, str | os.PathLike) and os.fspath(path) == RESUME


def plain_state(checkpoint: Mapping[str, Any], dropped: set[str] | None = None
                ) -> dict[str, Any]:
    """Lightning's checkpoint dict without what tierckpt saves through DCP (``state_dict``,
    ``optimizer_states``): the values that go into every rank's blob.

    They must load with ``torch.load(weights_only=True)`` (a restore unpickles nothing
    else), and that is checked here, at save time, not first at a restart. A hyper-parameter
    entry that does not load (an OmegaConf container, its type) is left out and its key
    added to ``dropped`` (``fit`` never reads them when resuming); any other such entry is a
    :class:`ConfigError` naming it.
    """
    plain = {k: v for k, v in checkpoint.items() if k not in _DCP_KEYS}
    if weights_only_problem(plain) is None:
        return plain
    for key in list(plain):
        problem = weights_only_problem(plain[key])
        if problem is None:
            continue
        if key in _HPARAM_KEYS:
            del plain[key]
            if dropped is not None:
                dropped.add(key)
            continue
        raise ConfigError(
            f"checkpoint[{key!r}] does not load with torch.load(weights_only=True), so a "
            f"restart could not read it ({problem}); keep what callbacks, the datamodule and "
            "on_save_checkpoint store to dicts, lists, numbers, strings and tensors, or "
            "register the class with torch.serialization.add_safe_globals")
    return plain


def resumed_epoch(plain: dict[str, Any]) -> int | None:
    """The training epoch Lightning resumes into from the plain state of a save made at
    ``on_train_batch_end``, fixing up the saved data-loader states on the way (None: no
    fit-loop state).

    Lightning's restart logic takes a save on the last batch of an epoch as the end of that
    epoch and resumes in the next one. A ``StatefulDataLoader`` restored from that state,
    though, first yields the empty rest of the old epoch (torchdata 0.11), which Lightning
    would count as the whole next epoch (one epoch of data skipped): such loader states are
    marked finished, so the loader begins the next epoch, as the run that was not
    interrupted did. No I/O: it reads and changes only ``plain``.
    """
    fit = plain.get("loops", {}).get("fit_loop")
    if not isinstance(fit, dict) or "epoch_progress" not in fit:
        return None
    epoch = int(fit["epoch_progress"]["current"]["processed"])
    batches = fit.get("epoch_loop.batch_progress", {})
    total = batches.get("total", {})
    if not (batches.get("is_last_batch")
            and total.get("completed") == total.get("processed", 0) - 1):
        return epoch
    for loader_state in fit.get("state_dict", {}).get("combined_loader", []):
        if isinstance(loader_state, dict) and "_iterator_finished" in loader_state:
            loader_state["_iterator_finished"] = True
    return epoch + 1


def _set_sampler_epoch(dataloader: object, epoch: int) -> None:
    for sampler in (getattr(dataloader, "sampler", None),
                    getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]


class _NothingToRestore(dict):  # type: ignore[type-arg]
    """What ``load_checkpoint`` returns on a fresh start. Lightning's version migration
    reads the version key, then every restore step starts with ``if not checkpoint:
    return``: a falsy dict is how a strategy says "nothing to restore"."""

    def __init__(self) -> None:
        super().__init__({"pytorch-lightning_version": pl.__version__})

    def __bool__(self) -> bool:
        return False


if TYPE_CHECKING:
    from pytorch_lightning.strategies import ParallelStrategy as _Base
else:
    _Base = object


class TierckptStrategy(_Base):
    """Mix in before a Lightning parallel strategy (``class S(TierckptStrategy, DDPStrategy)``)
    so that ``save_checkpoint``/``load_checkpoint``/``remove_checkpoint`` of the path
    :data:`RESUME` go through a :class:`~tierckpt.CheckpointManager`; other paths are the
    base strategy's. ``tierckpt``: a :class:`~tierckpt.ManagerConfig` or a mapping of its
    fields; every other argument goes to the base strategy.

    Lifecycle per ``fit``: ``setup_environment`` (process group via ``init_distributed``
    under torchrun; Lightning's ``timeout=`` bounds it) → ``setup`` (the base wraps the model
    and builds the optimizer; then the manager opens, on every rank) → ``load_checkpoint``
    (restore, or a fresh start) → saves → ``teardown`` (closes the manager: waits for the
    in-flight save and raises its error). ``validate``/``test``/``predict`` with
    ``ckpt_path=RESUME`` load the model weights only, read-only, through
    :func:`tierckpt.load` (tier 1, else tier 2).
    """

    def __init__(self, *args: Any, tierckpt: ManagerConfig | Mapping[str, Any],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(tierckpt, Mapping):
            tierckpt = ManagerConfig(**tierckpt)
        if not isinstance(tierckpt, ManagerConfig):
            raise ConfigError("tierckpt= must be a tierckpt.ManagerConfig or a dict of its "
                              f"fields, got {type(tierckpt).__name__}")
        self.tierckpt_config = tierckpt
        self.restored: RestoreInfo | None = None
        """What the last ``fit(ckpt_path=RESUME)`` restored (None: a fresh start)."""
        self.last_save: SaveHandle | None = None
        self.dropped_keys: set[str] = set()
        """Hyper-parameter keys left out of saves because they do not load safely."""
        self._warned: set[str] = set()
        self._manager: CheckpointManager | None = None
        self._resume_requested = False
        self._from_tierckpt = False  # the checkpoint Lightning is restoring came from us
        self._lean = False  # inside save_now: Lightning need not gather model/optimizer state
        self._resume_epoch: int | None = None  # set on samplers until training starts
        self._failed = False
        self._state: TrainState | None = None  # reused: its StateCapture learns once

    # -- for the callback and the user --------------------------------------------------
    @property
    def manager(self) -> CheckpointManager:
        """The open manager (during ``fit``, after ``setup``)."""
        if self._manager is None:
            raise ConfigError("the tierckpt CheckpointManager is open only during fit(), "
                              "after the strategy's setup")
        return self._manager

    def save_now(self, trainer: pl.Trainer) -> SaveHandle:
        """Save through tierckpt at ``trainer.global_step`` (collective: every rank calls it
        at the same step). Blocks for Lightning's ``dump_checkpoint`` and tierckpt's staging;
        the write is asynchronous (``handle.durable``)."""
        self._lean = True
        try:
            trainer.save_checkpoint(RESUME, weights_only=False)
        finally:
            self._lean = False
        assert self.last_save is not None
        return self.last_save

    def check_resumed(self) -> None:
        """Raise :class:`ConfigError` when this ``fit`` did not resume through tierckpt but
        tier 1 already holds a committed step: its saves would collide with, or silently
        continue, another run. (Tier 2 is not consulted here.) Called when training starts
        (the strategy's ``on_train_start``)."""
        last = self.manager.last_committed
        if self._resume_requested or last is None:
            return
        raise ConfigError(
            f"tier1 {self.tierckpt_config.tier1} already holds step {last}, but fit() did "
            f"not resume from it: pass trainer.fit(..., ckpt_path={RESUME!r}) (it resumes "
            "from the newest complete checkpoint on tier 1 or tier 2, or starts fresh), or "
            "point tier1 at a new directory")

    # -- Lightning's hooks ----------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after ``setup``: the optimizer must exist to be loaded in place."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """False for our checkpoints: the optimizer was loaded with the model, through DCP."""
        return not self._from_tierckpt and super().lightning_restore_optimizer

    def setup_environment(self) -> None:
        self._init_process_group()
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._resume_requested = self._from_tierckpt = self._failed = False
        self._resume_epoch = None
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.restored = None
        if len(self.optimizers) > 1:
            raise ConfigError(f"{type(self).__name__} saves one optimizer (a TrainState "
                              f"holds one); configure_optimizers returned "
                              f"{len(self.optimizers)}")
        self._manager = CheckpointManager(self.tierckpt_config)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        if not is_resume_path(filepath):
            return super().save_checkpoint(checkpoint, filepath,
                                           storage_options=storage_options)
        if storage_options is not None:
            raise ConfigError(f"save_checkpoint({RESUME!r}) takes no storage_options: "
                              "tiers are set in the strategy's tierckpt= config")
        manager = self.manager
        plain = plain_state(checkpoint, dropped=self.dropped_keys)
        self._warn_dropped()
        state = self._train_state(extra={LIGHTNING_KEY: plain})
        self.last_save = manager.save(int(checkpoint["global_step"]), state)
        return None

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self._from_tierckpt = False
        if not is_resume_path(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self._manager is None:
            return self._load_weights()
        self._resume_requested = True
        return self._restore()

    def remove_checkpoint(self, filepath: Any) -> None:
        if not is_resume_path(filepath):  # retention of ours is keep_last / tier2_keep_*
            super().remove_checkpoint(filepath)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._from_tierckpt:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._from_tierckpt:
            super().load_optimizer_state_dict(checkpoint)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Inside save_now the model goes through DCP: skip the base's copy (a full gather
        # under FSDP's "full" state dict, a CPU copy under ModelParallel).
        return {} if self._lean else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {} if self._lean else super().optimizer_state(optimizer)

    def process_dataloader(self, dataloader: object) -> object:
        # Lightning creates the training iterator (FitLoop.setup_data) before it sets the
        # sampler's epoch (on_advance_start); a StatefulDataLoader draws its sampler's order
        # at iter(), so a resume in epoch >= 1 would replay epoch 0's order of a
        # DistributedSampler. Set the resumed epoch here, where Lightning hands us the
        # loader before that iter().
        dataloader = super().process_dataloader(dataloader)
        if self._resume_epoch is not None:
            _set_sampler_epoch(dataloader, self._resume_epoch)
        return dataloader

    def on_train_start(self) -> None:
        self._resume_epoch = None
        self.check_resumed()
        super().on_train_start()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        manager, self._manager = self._manager, None
        try:
            if manager is not None and self._failed:
                # A failed fit is about to be restarted: do not hold the restart for the
                # upload drain (the uploader resumes from its records), and let the
                # training error be the one raised; ours goes to the log.
                try:
                    manager.close(after_error=True)
                except CheckpointError as e:
                    _log.error("closing the checkpoint manager after a failed fit: %s", e)
            elif manager is not None:
                manager.close()
        finally:
            super().teardown()

    # -- internals ------------------------------------------------------------------------
    def _train_state(self, extra: dict[str, Any]) -> TrainState:
        """The ``TrainState`` of the current model and optimizer with ``extra``: one object
        while they stay the same, so its :class:`~tierckpt.state_capture.StateCapture`
        derives the state dicts' keys once, not every save."""
        model = self.model if self.model is not None else self.lightning_module
        assert model is not None
        optimizer = self.optimizers[0] if self.optimizers else None
        state = self._state
        if state is None or state.model is not model or state.optimizer is not optimizer:
            state = self._state = TrainState(model=model, optimizer=optimizer, extra=extra)
        state.extra = extra
        return state

    def _restore(self) -> dict[str, Any]:
        state = self._train_state(extra={})
        info = self.manager.restore(state)
        self.restored = info
        if info is None:
            _log.info("ckpt_path=%r: no checkpoint on tier 1 or tier 2, a fresh start", RESUME)
            return _NothingToRestore()
        plain = (state.extra or {}).get(LIGHTNING_KEY)
        if not isinstance(plain, dict):
            raise ConfigError(f"step {info.step} in {info.path} was not saved by "
                              "tierckpt.integrations.lightning (no Lightning state in it)")
        self._resume_epoch = resumed_epoch(plain)
        self._from_tierckpt = True
        _log.info("restored step %d from %s (%.2f s)", info.step, info.source, info.seconds)
        return plain

    def _load_weights(self) -> dict[str, Any]:
        from tierckpt.share.loader import load  # only evaluation needs the share readers

        cfg = self.tierckpt_config
        model = self.model if self.model is not None else self.lightning_module
        sources = [s for s in (str(cfg.tier1) if cfg.tier1.is_dir() else None,
                                cfg.tier2.url if cfg.tier2 is not None else None) if s]
        for source in sources:
            try:
                result = load(source, model)
            except NoCheckpointError:
                continue
            self._from_tierckpt = True
            return {"pytorch-lightning_version": pl.__version__, "global_step": result.step}
        raise NoCheckpointError(f"ckpt_path={RESUME!r}: no committed checkpoint in "
                                f"{' or '.join(sources) or cfg.tier1}")

    def _init_process_group(self) -> None:
        if dist.is_initialized() or not isinstance(self.cluster_environment,
                                                   TorchElasticEnvironment):
            return
        cfg = self.tierckpt_config
        cfg.tier1.mkdir(mode=cfg.writes.dir_mode, parents=True, exist_ok=True)
        timeout: timedelta = getattr(self, "_timeout", None) or DEFAULT_TIMEOUT
        init_distributed(getattr(self, "_process_group_backend", None), timeout=timeout,
                         event_log=cfg.tier1 / layout.EVENTS)

    def _warn_dropped(self) -> None:
        new = self.dropped_keys - self._warned
        if new and self.is_global_zero:
            _log.warning("not saved (they do not load with weights_only=True; fit() does not "
                         "need them to resume): %s", ", ".join(sorted(new)))
            self._warned = set(self.dropped_keys)


class TierckptDDPStrategy(TierckptStrategy, DDPStrategy):
    """``DDPStrategy`` with tierckpt checkpoints (tested: CPU, gloo, 2 ranks, torchrun)."""


class TierckptFSDPStrategy(TierckptStrategy, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) with tierckpt checkpoints: the sharded state goes through
    ``get_state_dict`` of the wrapped root, whatever ``state_dict_type`` says."""


class TierckptModelParallelStrategy(TierckptStrategy, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel, DTensor state) with tierckpt."""


class TierckptCheckpoint(Checkpoint):
    """Decides when to save; the strategy (a :class:`TierckptStrategy`) saves.

    Saves at ``on_train_batch_end`` of a batch that stepped the optimizer (a batch that only
    accumulated gradients is never a save point): every ``every_n_steps`` optimizer steps,
    or — with ``every_n_steps=None`` — when ``CheckpointManager.should_save`` says so (give
    the config an ``interval=``), and at the final step (``max_steps``, or the last batch of
    ``max_epochs``; not a stop by ``EarlyStopping``) unless ``save_last=False``. Being a
    Lightning ``Checkpoint``, it runs
    after the other callbacks' ``on_train_batch_end`` and replaces Lightning's default
    ``ModelCheckpoint``.

    ``hang_timeout`` (seconds): run a :class:`tierckpt.StepWatchdog` over the optimizer
    steps — a rank that completes none for that long dumps its stacks and exits, so torchrun
    restarts the job; it also records ``first_step`` for ``tierckpt report``.

    """

    def __init__(self, *, every_n_steps: int | None = None, save_last: bool = True,
                 hang_timeout: float | None = None) -> None:
        super().__init__()
        if every_n_steps is not None and (isinstance(every_n_steps, bool)
                                          or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ConfigError(f"every_n_steps must be an int >= 1 or None (use the manager's "
                              f"interval=), got {every_n_steps!r}")
        self.every_n_steps, self.save_last, self.hang_timeout = every_n_steps, save_last, \
            hang_timeout
        self._seen: int | None = None
        self._watchdog: StepWatchdog | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _strategy(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _strategy(trainer)
        if self.every_n_steps is None and strategy.manager.config.interval is None:
            raise ConfigError("TierckptCheckpoint(every_n_steps=None) follows the manager's "
                              "should_save(): give ManagerConfig an interval= (e.g. "
                              "tierckpt.AutoInterval(node_mtbf='30d')) or pass every_n_steps")
        self._seen = trainer.global_step
        if self.hang_timeout is not None:
            self._watchdog = StepWatchdog(
                self.hang_timeout, event_log=strategy.tierckpt_config.tier1 / layout.EVENTS,
                rank=trainer.global_rank).start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._seen:  # gradients accumulated, the optimizer did not step
            return
        self._seen = step
        if self._watchdog is not None:
            self._watchdog.step_completed(step)
        strategy = _strategy(trainer)
        due = (step % self.every_n_steps == 0 if self.every_n_steps is not None
               else strategy.manager.should_save(step))
        if due or (self.save_last and _final_step(trainer, step)):
            strategy.save_now(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_watchdog()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._close_watchdog()

    def _close_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.close()


def _strategy(trainer: pl.Trainer) -> TierckptStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, TierckptStrategy):
        raise ConfigError(f"TierckptCheckpoint needs a tierckpt strategy (e.g. "
                          f"Trainer(strategy=TierckptDDPStrategy(tierckpt=...))), got "
                          f"{type(strategy).__name__}")
    return strategy


def _final_step(trainer: pl.Trainer, step: int) -> bool:
    """The last optimizer step ``fit`` will take: ``max_steps``, or the last batch of the
    last epoch (``max_epochs``)."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    return (max_epochs is not None and max_epochs >= 0 and trainer.is_last_batch
            and trainer.current_epoch + 1 >= max_epochs)
