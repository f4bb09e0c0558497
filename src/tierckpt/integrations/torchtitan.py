"""tierckpt inside torchtitan (0.3): :class:`TierckptCheckpointManager`, a
``BaseCheckpointManager`` that a ``Trainer.Config`` selects with one line
(``checkpoint=tierckpt_config(...)``). Importing this module imports torchtitan;
``import tierckpt`` never does.

Who calls what (torchtitan's ``trainer.py``, on every rank)::

    config.checkpoint.build(dataloader=, model_parts=,      the pieces become one TrainState;
        optimizers=, lr_schedulers=, states=, ...)          tierckpt.CheckpointManager opens
        ▼                                                   tier 1 (and tier 0, tier 2)
    checkpointer.load(step=-1)                              newest complete, verified step on
        ▼                                                   tier 0/1/2; else initial_load_path
    every step:  maybe_wait_for_staging()                   waits for save()'s background copy
                 optimizers.step(); lr_schedulers.step()
                 save(step, last_step=...)                  torchtitan's interval rule; blocks
        ▼                                                   for buffers and small state (C)
    checkpointer.close()                                    waits for the last save, drains
                                                            tier 2, releases tier 1

What goes where (TrainState's layout, ``docs/format.md``)::

    ModelWrapper(model_parts).state_dict()   -> "model"  DCP shards (DTensor: FSDP2, TP)
    OptimizersContainer.state_dict()         -> "optim"  DCP shards (torchtitan's flat FQN keys)
    LRSchedulersContainer.state_dict()       -> the per-rank blob
    the data loader's StatefulDataLoader     -> the per-rank blob, with its dp rank and degree
      state (not torchtitan's pickle of it)
    states (train_state: step, ntokens_seen) -> the per-rank blob (TrainState.extra)
    every RNG stream of every rank           -> the per-rank blob (torchtitan saves none)

Where torchtitan's own ``CheckpointManager`` behaves in a way tierckpt cannot keep, the
config refuses it when it is built (before any GPU work), with the change to make:
``last_save_model_only`` / ``last_save_in_hf`` (the last save is the whole state; export
with ``tierckpt export``), ``create_seed_checkpoint`` (make the seed with the stock manager,
load it with ``initial_load_path``), ``load_step`` other than -1 (tierckpt resumes from the
newest complete, verified step), ``exclude_from_loading`` naming ``train_state`` (the step
would restart at 0 in a folder that holds later steps), a remote ``folder`` as tier 1.

This is one module: the adapters below exist only to fit torchtitan's containers into
TrainState's slots.

Over the 400-line module budget on purpose: it follows torchtitan's
``BaseCheckpointManager`` hooks one to one, and splitting them would scatter one framework
contract over files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

try:
    import torchtitan
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.checkpointer import (
        DATALOADER,
        LR_SCHEDULER,
        OPTIMIZER,
        TRAIN_STATE,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.components.checkpointer.dcp import CheckpointManager as _StockManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.tools.filesystem import is_remote
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tierckpt.integrations.torchtitan needs torchtitan (0.3): "
                      "pip install 'tierckpt[torchtitan]'") from e
from torch import nn

from tierckpt.config import Failures, ManagerConfig, Tier0, Tier2, Verify
from tierckpt.errors import CheckpointError, ConfigError, StateMismatchError
from tierckpt.integrations._plain import require_plain
from tierckpt.manager import CheckpointManager
from tierckpt.model_state import optimizer_tensors
from tierckpt.policy.checks import check_enum
from tierckpt.policy.interval import AutoInterval
from tierckpt.policy.units import check_count
from tierckpt.restore.loader import RestoreInfo
from tierckpt.state import TrainState

__all__ = ["EXTRA_KEY", "TierckptCheckpointManager", "save_due", "tierckpt_config"]

_log = logging.getLogger("tierckpt")

EXTRA_KEY = "torchtitan"
"""Where the ``states`` (``train_state``) live in ``TrainState.extra``."""

_KEEP_ALL = sys.maxsize  # keep_latest_k=0: keep every checkpoint
_NEVER_CREATED = ".initial-load-never-created"  # sends the stock loader to initial_load_*
_LAST_SAVE = ("last_save_model_only", "last_save_in_hf", "export_dtype")


def save_due(step: int, *, last_step: bool, first_step: bool, interval: int | None,
             auto: bool = False) -> bool:
    """Whether ``save(step, last_step)`` saves: torchtitan's rule
    (``dcp.CheckpointManager._should_save``) — the last step, step 1 with
    ``enable_first_step_checkpoint``, and every ``interval``-th step. With ``interval=None``
    tierckpt's :class:`~tierckpt.AutoInterval` decides instead (``auto``: its verdict for
    this step). Pure."""
    if last_step or (first_step and step == 1):
        return True
    return auto if interval is None else step % interval == 0


class TierckptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager interface over :class:`tierckpt.CheckpointManager`.

    torchtitan builds it (``config.checkpoint.build(...)``) on every rank after the model is
    parallelised and the optimizers, LR schedulers and data loader exist; every method is
    collective. ``save(step)`` blocks only while the state is staged into host memory; the
    write, the commit, retention and the promotion to tier 2 run in the background (one save
    in flight; its error surfaces at the next ``save()``, ``maybe_wait_for_saving()`` or
    ``close()``). ``self.manager`` is the underlying manager, ``self.restored`` what
    ``load()`` restored (a :class:`~tierckpt.RestoreInfo`, or None).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint fields (``interval``, ``keep_latest_k``, ...) plus
        tierckpt's. ``folder`` is tier 1, under the job's dump folder, unless ``tier1`` is
        set; ``keep_latest_k`` is tier 1's ``keep_last`` (0: keep all)."""

        tier1: str | None = None
        """Tier-1 directory (node-local disk); default: dump_folder/folder."""

        tier2: str | None = None
        """s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or file:///path
        (:class:`tierckpt.Tier2`): promoted to, restored from when tier 1 lacks a step."""

        upload_every: int = 1
        """Promote every N-th committed step to tier 2."""

        tier2_keep_last: int = 3
        """Checkpoints kept on tier 2."""

        tier0: str | None = None
        """Node RAM first: a tmpfs directory, or 'auto' for ``tierckpt.Tier0()`` (the default
        location, off where it does not fit; docs/tier0.md); off by default. A string, not
        a Tier0: torchtitan's configs come from the command line and TOML."""

        tier1_every: int = 1
        """With tier0: every N-th save is also copied to tier 1."""

        verify: Literal["sizes", "full"] = "sizes"
        # the values of tierckpt.Verify, as a Literal: tyro parses the flag from it
        """Check before restoring: sizes and digests, or also every file's CRC32C."""

        node_mtbf: str | None = None
        """Set (e.g. '30d') to let tierckpt choose when to save (Young/Daly from measured
        costs) instead of interval."""

        collective_timeout_s: float = 300.0
        """How long a save or restore waits for other ranks before failing."""

        upload_drain_s: float = 600.0
        """At close(): time the uploader gets to copy what is due to tier 2."""

        last_save_model_only: bool = False
        """Must stay False: the last save holds the whole state (tierckpt export)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)  # slots: no zero-arg super()
            _refuse_unkept(self)
            self.manager_config()  # every tierckpt knob is checked now, not at build()

        def manager_config(self, base_folder: str = "") -> ManagerConfig:
            """The :class:`tierckpt.ManagerConfig` this config means for a job whose dump
            folder is ``base_folder``."""
            tier1 = self.tier1 or os.path.join(base_folder, self.folder)
            for name in ("upload_every", "tier2_keep_last", "tier1_every"):  # even when unused
                check_count(name, getattr(self, name))
            tier2 = None if self.tier2 is None else Tier2(
                self.tier2, upload_every=self.upload_every, keep_last=self.tier2_keep_last,
                drain_s=self.upload_drain_s)
            tier0 = None if self.tier0 is None else Tier0(
                None if self.tier0 == "auto" else Path(self.tier0),
                tier1_every=self.tier1_every)
            return ManagerConfig(
                tier1=Path(tier1), keep_last=self.keep_latest_k or _KEEP_ALL,
                verify=check_enum("verify", Verify, self.verify), tier2=tier2,
                tier0=tier0,
                interval=AutoInterval(node_mtbf=self.node_mtbf) if self.node_mtbf else None,
                failures=Failures(collective_timeout_s=self.collective_timeout_s))

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future: Future[Any] | None = None
        if not self.enable:  # like the stock manager: no attributes, every call returns
            return
        if not isinstance(config, TierckptCheckpointManager.Config):
            raise ConfigError(f"TierckptCheckpointManager needs its own Config, got "
                              f"{type(config).__qualname__}; use tierckpt_config(...)")
        self.config, self.interval, self.load_only = config, config.interval, config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.states = dict(states)  # a copy: the stock manager adds its pieces to the caller's
        _check_exclusions(self.exclude_from_loading, self.states)
        self._pieces = {"dataloader": dataloader, "model_parts": model_parts,
                        "optimizers": optimizers, "lr_schedulers": lr_schedulers,
                        "sd_adapter": sd_adapter}
        wrapper, skip = ModelWrapper(model_parts), set(self.exclude_from_loading)
        self.state = _titan_state(wrapper, optimizers, lr_schedulers, dataloader)
        self._load_state = self.state if not skip else _titan_state(
            wrapper, None if OPTIMIZER in skip else optimizers,
            None if LR_SCHEDULER in skip else lr_schedulers,
            None if DATALOADER in skip else dataloader)
        self._plain_states()  # a state that does not load weights_only fails now
        manager_config = config.manager_config(base_folder)
        self.folder = str(manager_config.tier1)
        self.restored: RestoreInfo | None = None
        self.manager = CheckpointManager(manager_config)

    # -- BaseCheckpointManager's hooks ----------------------------------------------------
    def _load(self, step: int = -1) -> bool:
        """Restore the newest complete, verified checkpoint on tier 0, 1 or 2 into the model
        parts, optimizers, LR schedulers, data loader, ``states`` and every RNG stream, less
        ``exclude_from_loading``; on a fresh start, load ``initial_load_path`` (or the HF
        weights) through torchtitan's own loader. False when there was nothing to load."""
        if step != -1:
            raise ConfigError(f"load(step={step}): tierckpt resumes from the newest complete, "
                              "verified checkpoint; see Config.load_step")
        self._wait_for_saving()  # a save of this process is on tier 1 before the choice
        extra: dict[str, Any] = {}
        self._load_state.extra = extra
        info = self.manager.restore(self._load_state)
        if info is None:
            return self._initial_load()
        values = extra.get(EXTRA_KEY)
        if not isinstance(values, dict):
            raise StateMismatchError(
                f"step {info.step} ({info.path}) was not saved by "
                "tierckpt.integrations.torchtitan (no train_state in it); model, optimizer "
                "and RNG were loaded, the trainer's step was not")
        self._apply_states(values["states"], info)
        self.restored = info
        _log.info("tierckpt: restored step %d from %s in %.2f s", info.step, info.source,
                  info.seconds)
        return True

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save after step ``curr_step`` when torchtitan's rule (:func:`save_due`) says so.
        Blocks while staging; the last step's save also waits until it is committed (the
        stock manager writes it synchronously)."""
        cadence = self.manager.config.interval is not None
        auto = self.manager.should_save(curr_step) if cadence else False  # every step
        if self.load_only or not save_due(
                curr_step, last_step=last_step, auto=auto,
                first_step=self.config.enable_first_step_checkpoint,
                interval=None if cadence else self.interval):
            return False
        self.state.extra = {EXTRA_KEY: {"states": self._plain_states(),
                                        "version": torchtitan.__version__}}
        self.save_future = self.manager.save(curr_step, self.state).durable
        if last_step:
            self._wait_for_saving()
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Wait for the last save's background copies (``staging="overlap"``: parameters
        and optimizer state are copied during the forward/backward after ``save()``).
        torchtitan calls this before every ``optimizers.step()``; the step pre-hook tierckpt
        puts on the optimizers container would wait as well."""
        self.manager.wait_for_staging()

    def _wait_for_saving(self) -> None:
        """Block until the in-flight save is committed on tier 1 (or tier 0); raise its
        error."""
        self.save_future = None
        self.manager.wait()

    def _close(self) -> None:
        """Wait for the in-flight save, drain tier 2 (``upload_drain_s``), release tier 1.
        Called while an exception is being handled — torchtitan's ``train.py`` closes the
        trainer in its ``except`` block — it closes as ``close(after_error=True)``: no tier-0
        flush and no drain (other ranks may be gone), and a save error is logged rather than
        raised over the exception that ended training."""
        manager = getattr(self, "manager", None)
        if manager is None:
            return
        self.save_future = None
        if sys.exc_info()[1] is None:
            manager.close()
            return
        try:
            manager.close(after_error=True)
        except CheckpointError as e:
            _log.error("tierckpt: closing after an error: %s", e)

    def __enter__(self) -> TierckptCheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None or getattr(self, "manager", None) is None:
            self.close()
            return
        with contextlib.suppress(CheckpointError):
            self.manager.close(after_error=True)

    # -- internals ------------------------------------------------------------------------
    def _plain_states(self) -> dict[str, Any]:
        return {key: require_plain(f"states[{key!r}].state_dict()", obj.state_dict())
                for key, obj in self.states.items()}

    def _apply_states(self, saved: dict[str, Any], info: RestoreInfo) -> None:
        for key, obj in self.states.items():
            if key in self.exclude_from_loading:
                continue
            if key not in saved:
                raise StateMismatchError(
                    f"step {info.step} ({info.path}) holds no states[{key!r}] (it holds "
                    f"{sorted(saved)}); model, optimizer and RNG were loaded. Build the "
                    "trainer with the same states, or add the key to exclude_from_loading")
            obj.load_state_dict(saved[key])

    def _initial_load(self) -> bool:
        """A fresh start: ``initial_load_path`` (a stock torchtitan DCP folder, or HF
        safetensors) or the HF assets, read by torchtitan's own manager — pointed at a
        folder that never exists, so it takes its initial-load branch. That path is the
        stock format and loader (including its pickled data-loader state), not tierckpt's."""
        cfg = self.config
        if not (cfg.initial_load_path or cfg.initial_load_in_hf):
            return False
        stock = _StockManager(
            _StockManager.Config(
                enable=True, folder=os.path.join(self.folder, _NEVER_CREATED),
                keep_latest_k=0, initial_load_path=cfg.initial_load_path,
                initial_load_model_only=cfg.initial_load_model_only,
                initial_load_in_hf=cfg.initial_load_in_hf,
                initial_load_in_hf_quantized=cfg.initial_load_in_hf_quantized,
                exclude_from_loading=list(cfg.exclude_from_loading)),
            states=dict(self.states), **self._pieces)
        try:
            return bool(stock.load())
        finally:
            stock.close()


def tierckpt_config(checkpoint: BaseCheckpointManager.Config | None = None,
                    **knobs: Any) -> TierckptCheckpointManager.Config:
    """A :class:`TierckptCheckpointManager.Config` that keeps the torchtitan fields of
    ``checkpoint`` (a model's stock ``config.checkpoint``: ``interval``, ``keep_latest_k``,
    ``folder``, ``initial_load_*``, ...) with ``knobs`` applied on top
    (``enable=True, tier2="s3://..."``). The final-save fields (``last_save_model_only``,
    ``last_save_in_hf``, ``export_dtype``) are not carried over: the last save is the whole
    state; ``tierckpt export`` writes a model-only or Hugging Face copy."""
    base: dict[str, Any] = {}
    if checkpoint is not None:
        for f in dataclasses.fields(BaseCheckpointManager.Config):
            if f.init and f.name not in _LAST_SAVE:
                base[f.name] = getattr(checkpoint, f.name)
        if checkpoint.last_save_in_hf and "last_save_in_hf" not in knobs:
            _log.warning("tierckpt_config: last_save_in_hf is not carried over; export the "
                         "final step with `tierckpt export STEP --to DIR --hf-config ...`")
    return TierckptCheckpointManager.Config(**{**base, **knobs})


# -- checks -------------------------------------------------------------------------------
def _refuse_unkept(cfg: TierckptCheckpointManager.Config) -> None:
    """The stock settings this manager cannot keep, each with the change to make."""
    if cfg.last_save_model_only or cfg.last_save_in_hf:
        raise ConfigError(
            "last_save_model_only/last_save_in_hf: tierckpt's last save holds the whole "
            "training state (a job that is extended or restarted resumes from it); leave both "
            "False and write a model-only or Hugging Face copy with `tierckpt export STEP "
            "--to DIR --hf-config config.json` (docs/sharing.md)")
    if cfg.create_seed_checkpoint:
        raise ConfigError(
            "create_seed_checkpoint: make the seed with torchtitan's own CheckpointManager "
            "(one process, --checkpoint.create_seed_checkpoint) and start the tierckpt job "
            "with initial_load_path=<its step-0 folder>")
    if cfg.load_step != -1:
        raise ConfigError(
            f"load_step={cfg.load_step}: tierckpt always resumes from the newest complete, "
            "verified checkpoint on any tier; to go back to an older step, delete the newer "
            "ones (tier 1 and tier 2) first, or load it elsewhere with tierckpt.load()")
    if TRAIN_STATE in cfg.exclude_from_loading:
        raise ConfigError(
            f"exclude_from_loading={cfg.exclude_from_loading!r}: without {TRAIN_STATE!r} the "
            "step count restarts at 0 in a folder that holds later steps, and tierckpt's "
            "steps must increase; start a new folder with initial_load_path instead")
    if cfg.tier1 is None and is_remote(cfg.folder):
        raise ConfigError(
            f"folder={cfg.folder!r} is remote; tierckpt's tier 1 is a local directory: set "
            "tier1 to node-local disk and give the remote location as tier2")


def _check_exclusions(exclude: list[str], states: dict[str, Any]) -> None:
    known = {OPTIMIZER, LR_SCHEDULER, DATALOADER, *states}
    unknown = [k for k in exclude if k not in known]
    if unknown:
        raise ConfigError(f"exclude_from_loading names {unknown}, which is not saved; the "
                          f"keys are {sorted(known)} (the model is always loaded)")


# -- adapters: torchtitan's containers in TrainState's slots ---------------------------------
class _TitanModelState:
    """torchtitan's model and optimizer state, as a :class:`~tierckpt.model_state.ModelState`:
    the model parts through ``ModelWrapper`` (canonical FQNs, one flat dict across pipeline
    stages) and the ``OptimizersContainer``'s flat FQN-keyed dict (which reshards, and keeps
    pipeline stages from colliding), each applied by torchtitan's own ``load_state_dict``.
    The per-rank blob (RNG, scheduler, loader, extra) is TrainState's."""

    def __init__(self, wrapper: ModelWrapper, optimizers: Any) -> None:
        self.wrapper, self.optimizers = wrapper, optimizers

    def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        optim = self.optimizers.state_dict() if self.optimizers is not None else {}
        return self.wrapper.state_dict(), optim

    def load_state_dicts(self, model: dict[str, Any], optim: dict[str, Any] | None) -> None:
        self.wrapper.load_state_dict(model)
        if self.optimizers is not None and optim is not None:
            self.optimizers.load_state_dict(optim)

    def step_tensors(self) -> Iterator[Any]:
        """Every model part's parameters (pipeline stages) and the optimizers' state."""
        for part in self.wrapper.model:
            yield from part.parameters()
        yield from optimizer_tensors(self.optimizers)


def _titan_state(wrapper: ModelWrapper, optimizers: Any, lr_schedulers: Any,
                 dataloader: Any) -> TrainState:
    """A :class:`TrainState` whose model and optimizer state are torchtitan's own."""
    return TrainState(
        model=wrapper.model[0], optimizer=optimizers,
        scheduler=None if lr_schedulers is None else _Checked(lr_schedulers, "lr_schedulers"),
        dataloader=None if dataloader is None else _Loader(dataloader), extra={},
        model_state=_TitanModelState(wrapper, optimizers))


class _Checked:
    """A ``Stateful`` whose ``state_dict()`` is checked at every save to load with
    ``weights_only=True`` (a restart unpickles nothing else)."""

    def __init__(self, obj: Any, what: str) -> None:
        self.obj, self.what = obj, what

    def state_dict(self) -> Any:
        return require_plain(f"{self.what}.state_dict()", self.obj.state_dict())

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class _Loader:
    """torchtitan's data loader, without its pickle.

    ``ParallelAwareDataloader.state_dict()`` wraps the ``StatefulDataLoader`` state in
    ``pickle.dumps`` and ``load_state_dict`` runs ``pickle.loads`` on what a checkpoint
    holds (code from a checkpoint would run). This saves the ``StatefulDataLoader``'s own
    plain state beside the dp rank and degree, and refuses, as torchtitan does, a different
    dp degree. Any other loader's ``state_dict()`` is saved as it is, checked to be plain.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        dl = self.loader
        if not isinstance(dl, ParallelAwareDataloader):
            return {"state": require_plain(f"{type(dl).__name__}.state_dict()", dl.state_dict())}
        return {"dp_rank": dl.dp_rank, "dp_world_size": dl.dp_world_size,
                "state": require_plain("the data loader's state",
                                       StatefulDataLoader.state_dict(dl))}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        dl = self.loader
        if not isinstance(dl, ParallelAwareDataloader):
            dl.load_state_dict(saved["state"])
            return
        now = (dl.dp_rank, dl.dp_world_size)
        then = (saved.get("dp_rank"), saved.get("dp_world_size"))
        if then != now:
            raise StateMismatchError(
                f"the data loader was saved as dp rank {then[0]} of {then[1]} and is now dp "
                f"rank {now[0]} of {now[1]}; torchtitan's loaders cannot move a position to "
                "another dp layout. Add 'dataloader' to exclude_from_loading to start the "
                "data afresh (model, optimizer and RNG still resume)")
        StatefulDataLoader.load_state_dict(dl, saved["state"])
