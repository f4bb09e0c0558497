"""Gather and apply the whole training state through DCP's ``Stateful`` protocol.

Layout of :meth:`TrainState.state_dict` (what DCP sees)::

    {"model": {...}, "optim": {...},          # via torch.distributed.checkpoint.state_dict:
                                               # plain modules, DDP and FSDP2/DTensor alike
     "rank_state": {"<rank>": uint8 tensor}}   # per-rank blob, keyed by rank

The per-rank blob is a ``torch.save`` of ``{"rng", "scheduler", "dataloader", "extra",
"step", "rank", "world_size"}`` restricted to plain types, so it loads with
``weights_only=True``. Keying it by rank keeps DCP's de-duplication from merging ranks, and
keeps each rank's copy in its own shard file (so node-local tier 1 restores need no other
node's files).

Resume semantics:

- same world size: rank ``r`` loads its own blob; every RNG stream, the data-loader
  position, scheduler and ``extra`` continue exactly (bit-identical losses on CPU).
- different world size: model and optimizer are resharded by DCP; rank ``r`` loads the blob
  of old rank ``r % old_world``; scheduler and ``extra`` continue (they are the same on every
  rank in a data-parallel job); the data loader continues from the *global* sample position
  when its sampler has global semantics (``tierckpt.data.ResumableSampler``); the RNG
  streams are re-derived deterministically from (saved state, step, rank, world size).

One rule for bit-identical continuation: nothing may draw from the global RNG between
``restore()`` and the first step that the reference run did not also draw. The usual culprit
is ``iter(dataloader)``, which draws a base seed from the global torch RNG unless the loader
has its own ``generator=torch.Generator()`` — give it one (the example trainer does).
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tierckpt import _rng
from tierckpt._torch.core import flatten_dense_tensors
from tierckpt.data import global_rng_draw
from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.model_state import ModelState, TorchModelState

RANK_STATE = "rank_state"


def _require_stateful(name: str, obj: object, hint: str) -> None:
    if not (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))):
        raise ConfigError(f"TrainState({name}=...) needs an object with state_dict() and "
                          f"load_state_dict(); got {type(obj).__name__}. {hint}")


class TrainState:
    """Everything needed to continue training exactly: a DCP ``Stateful``.

    Arguments are keyword-only. ``model`` is an ``nn.Module`` (plain, DDP or FSDP2);
    ``optimizer`` a ``torch.optim.Optimizer``; ``scheduler`` an LR scheduler; ``dataloader``
    anything with ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``);
    ``extra`` a dict of plain values (ints, floats, strings, lists, dicts, tensors) that is
    saved and restored in place. RNG streams are captured automatically (``rng=False`` to
    opt out). ``model_state``: how the model and optimizer state is read and applied (a
    :class:`~tierckpt.model_state.ModelState`; default
    :class:`~tierckpt.model_state.TorchModelState` of ``model`` and ``optimizer``) — the
    seam for integrations whose model is several parts or whose optimizer is a container.
    ``strict``: refuse (ConfigError) a data loader whose iterator draws from the global RNG
    (:func:`tierckpt.data.global_rng_draw`: exact resume would be lost) instead of warning.
    """

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, dataloader: Any = None,
                 extra: dict[str, Any] | None = None, rng: bool = True,
                 model_state: ModelState | None = None, strict: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"TrainState(model=...) must be a torch.nn.Module, got "
                              f"{type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"TrainState(optimizer=...) must be a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
        if scheduler is not None:
            _require_stateful("scheduler", scheduler, "Pass a torch.optim.lr_scheduler object.")
        if dataloader is not None:
            _require_stateful("dataloader", dataloader,
                              "A plain torch DataLoader cannot resume its position; use "
                              "torchdata.stateful_dataloader.StatefulDataLoader.")
            _check_rng_draw(dataloader, strict=strict)
        if extra is not None and not (isinstance(extra, dict)
                                      and all(isinstance(k, str) for k in extra)):
            raise ConfigError("TrainState(extra=...) must be a dict with str keys")
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.dataloader = scheduler, dataloader
        self.extra = extra
        self.rng = rng
        self.step: int | None = None  # set by the manager before state_dict()/after restore
        if model_state is not None and not isinstance(model_state, ModelState):
            raise ConfigError(f"TrainState(model_state=...) must implement "
                              f"tierckpt.model_state.ModelState, got {type(model_state).__name__}")
        self.model_state: ModelState = model_state or TorchModelState(model, optimizer)

    # -- DCP Stateful ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state to save: model and optimizer (every key, for plain ``dcp.load``) and
        this rank's per-rank blob (which also carries the small leaves)."""
        out = self._model_optim()
        _, small = _split_small(out)
        out[RANK_STATE] = {str(_rank()): self._rank_blob(small)}
        return out

    def load_targets(self, *, source_rank: int, blob_bytes: int) -> dict[str, Any]:
        """The dict a load fills in place (then passed to :meth:`load_state_dict`): the
        model and optimizer tensors, and an empty ``blob_bytes``-byte buffer for the
        per-rank blob saved by ``source_rank`` (small leaves come from that blob, not from
        DCP). Which saved rank a rank reads after a reshard is the restorer's choice."""
        rest, _ = _split_small(self._model_optim())
        rest[RANK_STATE] = {str(source_rank): torch.empty(blob_bytes, dtype=torch.uint8)}
        return rest

    def tensors(self) -> dict[str, Any]:
        """Model and optimizer state as :meth:`state_dict` saves it (every key, live
        tensors, no per-rank blob): what a restore checks the checkpoint against."""
        return self._model_optim()

    def overlap_filter(self) -> Callable[[tuple[Any, ...], torch.Tensor], bool] | None:
        """For ``staging="overlap"``: which tensors of :meth:`state_dict` may be copied after
        ``save()`` returns — those whose storage is a parameter's or the optimizer state's,
        which only ``optimizer.step()`` changes (the manager waits for the copy in a step
        pre-hook). Buffers, the per-rank blob and anything else are copied at once. None
        without an optimizer: no step would wait for the copy."""
        if self.optimizer is None:
            return None
        live = {_storage_ptr(t) for t in self.model_state.step_tensors()}
        live.discard(0)
        return lambda path, t: _storage_ptr(t) in live

    def frozen_filter(self) -> Callable[[tuple[Any, ...], torch.Tensor], bool] | None:
        """Which tensors of :meth:`state_dict` are frozen parameters: those whose storage
        is a model parameter's with ``requires_grad=False`` (for ``Writes(incremental=
        True)``). None when the model has none."""
        frozen = {_storage_ptr(p) for p in self.model.parameters() if not p.requires_grad}
        frozen.discard(0)
        if not frozen:
            return None
        return lambda path, t: _storage_ptr(t) in frozen

    def _model_optim(self) -> dict[str, Any]:
        model_sd, optim_sd = self.model_state.state_dicts()
        out: dict[str, Any] = {"model": model_sd}
        if self.optimizer is not None:
            out["optim"] = optim_sd
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Apply a loaded state (the dict :meth:`state_dict` returned, filled by DCP)."""
        blobs = state_dict[RANK_STATE]
        (src, blob), = blobs.items()
        payload = self._decode_blob(blob)
        state_dict = dict(state_dict)
        for path, value in payload["small"].items():
            _set_path(state_dict, path, value)
        self.model_state.load_state_dicts(
            state_dict["model"], state_dict["optim"] if self.optimizer is not None else None)
        self._apply_rank_payload(payload, src_rank=int(src))

    # -- internals ------------------------------------------------------------------------
    def _rank_blob(self, small: dict[tuple[Any, ...], Any]) -> torch.Tensor:
        payload: dict[str, Any] = {
            "small": {k: v for k, v in small.items() if not isinstance(v, torch.Tensor)},
            "small_tensors": _pack({k: v for k, v in small.items()
                                    if isinstance(v, torch.Tensor)}),
            "step": self.step, "rank": _rank(), "world_size": _world(),
            "rng": _rng.capture() if self.rng else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "dataloader": (self.dataloader.state_dict() if self.dataloader is not None
                           else None),
            "extra": dict(self.extra) if self.extra is not None else None,
        }
        buf = io.BytesIO()
        torch.save(payload, buf)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    @staticmethod
    def _decode_blob(blob: torch.Tensor) -> dict[str, Any]:
        try:
            payload = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True,
                                 map_location="cpu")  # set_state_dict moves them back
        except (pickle.UnpicklingError, RuntimeError) as e:
            raise CheckpointError(
                "per-rank state (extra/dataloader/scheduler) holds objects that do not load "
                "with weights_only=True; keep them to dicts, lists, tuples, numbers, strings "
                f"and tensors (or register them with torch.serialization.add_safe_globals): {e}"
            ) from e
        if not isinstance(payload, dict):
            raise CheckpointError("per-rank state is not a dict (corrupt or foreign checkpoint)")
        if "small_tensors" in payload:  # blobs before this format kept them in "small"
            try:
                small = _unpack(payload.pop("small_tensors"))
            except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError,
                    RuntimeError) as e:
                raise CheckpointError(f"per-rank state: the packed small tensors do not "
                                      f"decode (corrupt or foreign checkpoint): {e}") from e
            payload["small"] = {**payload["small"], **small}
        return payload

    def _apply_rank_payload(self, payload: dict[str, Any], *, src_rank: int) -> None:
        same_world = payload["world_size"] == _world()
        if self.scheduler is not None and payload["scheduler"] is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        if self.dataloader is not None and payload["dataloader"] is not None:
            self.dataloader.load_state_dict(payload["dataloader"])
        if self.extra is not None and payload["extra"] is not None:
            self.extra.clear()
            self.extra.update(payload["extra"])
        if self.rng and payload["rng"] is not None:
            if same_world and src_rank == _rank():
                _rng.restore(payload["rng"])
            else:
                _rng.rederive(payload["rng"], step=int(payload["step"] or 0), rank=_rank(),
                              world_size=_world())
        self.step = payload["step"]


SMALL_BYTES = 64 * 1024
_PACK_ALIGN = 16  # every packed tensor starts at a multiple of the largest element size


def _pack(tensors: dict[tuple[Any, ...], torch.Tensor]) -> dict[str, Any]:
    """Small tensors as one CPU byte tensor and an index of ``(path, dtype name, shape,
    offset)``, pickled to bytes: one record for ``torch.save`` instead of one per tensor (a
    zip record each, which made the per-rank blob the slowest part of ``save()``), and one
    object for its pickler instead of ~7 per tensor (its per-object hook cost 3–5 ms for a
    transformer's 864 biases, norms and Adam ``step`` scalars). Tensors of one device and
    dtype are joined by one C++ call, each group starting at a multiple of
    ``_PACK_ALIGN``. On CPU, so a host without the saving GPU loads it."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[tuple[Any, ...], torch.Tensor]]] = {}
    for path, t in tensors.items():
        groups.setdefault((t.device, t.dtype), []).append((path, t))
    index, parts, pos = [], [], 0
    with torch.no_grad():
        for (_, dtype), members in groups.items():
            pad = -pos % _PACK_ALIGN
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8))
            pos += pad
            for path, t in members:
                index.append((path, str(dtype), tuple(t.shape), pos))
                pos += t.numel() * dtype.itemsize
            flat = flatten_dense_tensors([t for _, t in members])
            parts.append(flat.cpu().view(torch.uint8))
    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return {"data": data, "index": pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)}


def _unpack(packed: dict[str, Any]) -> dict[tuple[Any, ...], torch.Tensor]:
    """The tensors :func:`_pack` packed, each owning its own memory. The index is unpickled
    with no globals allowed (tuples, strings and numbers only); blobs written before it was
    pickled to bytes hold it as a list with ``torch.dtype``\\s."""
    data, index = packed["data"], packed["index"]
    if isinstance(index, bytes):
        index = _PlainUnpickler(io.BytesIO(index)).load()
    out = {}
    for path, dtype, shape, offset in index:
        dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        n = torch.Size(shape).numel() * dtype.itemsize
        out[tuple(path)] = data[offset:offset + n].view(dtype).reshape(shape).clone()
    return out


class _PlainUnpickler(pickle.Unpickler):
    """Builtin containers, strings and numbers only: any global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"per-rank state index names {module}.{name}: only "
                                     "tuples, lists, strings and numbers may appear there")


_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _split_small(tree: dict[Any, Any], path: tuple[Any, ...] = ()
                 ) -> tuple[dict[Any, Any], dict[tuple[Any, ...], Any]]:
    """Split replicated small leaves (non-tensors such as ``param_groups``, and plain tensors
    up to ``SMALL_BYTES`` such as Adam's ``step`` scalars, biases or norm buffers) from
    ``tree``.

    They are saved twice: once by DCP (de-duplicated, so plain ``dcp.load`` sees every key)
    and in every rank's blob, from which tierckpt restores them, so each node-local tier-1
    root is self-sufficient for a same-layout restore. DTensor shards and
    large tensors stay with DCP. The same predicate applied to the load-time targets selects
    the same keys, so the split needs no bookkeeping. Returns ``(rest, small)``; ``tree``
    is not modified (its dicts may be the optimizer's live state)."""
    rest: dict[Any, Any] = {}
    small: dict[tuple[Any, ...], Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            rest[k], sub = _split_small(v, (*path, k))
            small.update(sub)
        elif not isinstance(v, torch.Tensor) or (
                not isinstance(v, DTensor) and v.numel() * v.element_size() <= SMALL_BYTES):
            small[(*path, k)] = v
        else:
            rest[k] = v
    return rest, small


def _set_path(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (what views of one storage share), without creating
    a storage object (called for every tensor of every save)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.data_ptr() - local.storage_offset() * local.element_size())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _check_rng_draw(loader: Any, *, strict: bool) -> None:
    why = global_rng_draw(loader)
    if why is None:
        return
    msg = (f"TrainState(dataloader=...): {why}. Without it a resumed run's random streams "
           "differ from an uninterrupted run's (README: two rules for exact resume)")
    if strict:
        raise ConfigError(msg)
    warnings.warn(msg + "; TrainState(strict=True) refuses it", UserWarning, stacklevel=3)


def require_state(state: object) -> TrainState:
    """``state`` if it is a :class:`TrainState`, else ConfigError naming what it is."""
    if not isinstance(state, TrainState):
        raise ConfigError(f"expected a tierckpt.TrainState, got {type(state).__name__}")
    return state
