"""DCP's canonical model and optimizer state dicts, without re-deriving every key each save.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` is
``model.state_dict()`` and ``optimizer.state_dict()`` with the keys renamed to canonical
FQNs (DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.`` dropped; the optimizer's
parameter ids replaced by the FQNs of the parameters). It derives that renaming afresh on
every call by walking the module tree once per key: 18 ms of the 40 ms a ``save()`` of a
288-parameter transformer with AdamW blocked for, whatever the bytes.

:class:`StateCapture` calls both live ``state_dict()``\\s every time (hooks, extra state,
hyperparameters and optimizer state are always current) and reuses the renaming while what
it depends on is unchanged: the model's raw keys, the identities of the model's parameters
and of the optimizer's, in order. On the first call and whenever that changes, it calls
``get_state_dict`` itself, takes the renaming from it, and checks that the renamed dicts are
the same as ``get_state_dict``'s (same keys in the same order, the same tensors — storage,
shape, strides, dtype, placement — and equal values); if they are not, the capture uses
``get_state_dict`` from then on. ``get_state_dict`` is also used, every call, for FSDP1
(``FullyShardedDataParallel``) models, optimizers whose ``state_dict`` is not
``torch.optim.Optimizer``'s (containers, overrides), and an optimizer with no state and no
gradients yet (``get_state_dict`` creates the state with a zero-gradient step) — except
``torch.optim.Adam`` and ``AdamW``, whose state :func:`prime_state` creates as their own first
step would (zeros, step 0) without running one: a restore into a fresh process (a
replacement rank, a restart) loads into that state, and the zero-gradient step was the
largest part of its load (an Adam step over every parameter: 0.19 of 0.33 s for 128 MiB of
state per rank here).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from tierckpt._torch.core import adam_step_dtype

_log = logging.getLogger("tierckpt")

StateDicts = tuple[dict[str, Any], dict[str, Any]]


class StateCapture:
    """``get_state_dict(model, optimizer)`` for one model and optimizer (or none), fast.

    Not thread-safe; call it where ``get_state_dict`` would be called. The returned dicts
    are new on every call (the caller may add to them); their tensors are the live ones,
    as ``get_state_dict``'s are."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self._signature: tuple[Any, ...] | None = None
        self._model_keys: dict[str, str] = {}   # raw key -> canonical FQN (renamed only)
        self._param_fqns: list[str] = []        # optimizer parameter id (index) -> FQN
        self._fast = _supported(model, optimizer)
        self.calls = 0
        self.reference_calls = 0
        """Of ``calls``, how many ran ``get_state_dict`` itself (structure changes,
        fallbacks)."""

    def __call__(self) -> StateDicts:
        """The model and optimizer state dicts, as ``get_state_dict`` returns them."""
        self.calls += 1
        opt = self.optimizer
        if not self._fast or (opt is not None and not opt.state and not _has_grads(opt)
                              and not prime_state(opt)):
            return self._reference()  # it initialises the state with a zero-gradient step
        with torch.no_grad():
            raw = self.model.state_dict()
        signature = (tuple(raw), tuple(map(id, self.model.parameters())),
                     () if opt is None else tuple(map(id, _params(opt))))
        if signature != self._signature:
            return self._learn(raw, signature)
        return self._rename_model(raw), self._optim()

    def _reference(self) -> StateDicts:
        self.reference_calls += 1
        return get_state_dict(self.model, () if self.optimizer is None else self.optimizer)

    def _learn(self, raw: dict[str, Any], signature: tuple[Any, ...]) -> StateDicts:
        """Take the renaming from ``get_state_dict`` and check the fast path reproduces it."""
        model_sd, optim_sd = self._reference()
        # get_state_dict keeps the keys it does not rename in place and moves renamed ones
        # to the end, in order: match them up the same way
        kept = sum(k in model_sd for k in raw)
        renamed_raw = [k for k in raw if k not in model_sd]
        self._model_keys = dict(zip(renamed_raw, list(model_sd)[kept:], strict=False))
        # the optimizer's parameter ids count through its groups in order, and so do the
        # FQNs that replace them in get_state_dict's param_groups
        self._param_fqns = [fqn for g in optim_sd.get("param_groups", ()) for fqn in g["params"]]
        mine = self._rename_model(raw), self._optim()
        if not _same(mine, (model_sd, optim_sd)):  # a key count that differs fails it too
            self._fast = False
            _log.debug("state capture: the renamed state dicts differ from get_state_dict's; "
                       "using get_state_dict for every save")
        else:
            self._signature = signature
        return model_sd, optim_sd

    def _rename_model(self, raw: dict[str, Any]) -> dict[str, Any]:
        keys = self._model_keys
        if not keys:
            return raw
        out = {k: v for k, v in raw.items() if k not in keys}
        out.update((keys[k], v) for k, v in raw.items() if k in keys)
        return out

    def _optim(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        osd = self.optimizer.state_dict()
        fqns = self._param_fqns
        state = {fqns[pid]: v for pid, v in osd["state"].items()}
        groups = [{**g, "params": [fqns[pid] for pid in g["params"]]}
                  for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}


_PRIMED = (torch.optim.Adam, torch.optim.AdamW)


def prime_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create the state of a ``torch.optim.Adam`` or ``AdamW`` (exactly those classes) that
    has none, as its ``_init_group`` does before its first step: ``step`` a 0-d tensor (on
    the parameter's device when ``capturable`` or ``fused``, else on the CPU), ``exp_avg``
    and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``) zeros shaped and placed like
    the parameter (a DTensor for a DTensor parameter). Every parameter that requires grad
    gets state, as DCP's zero-gradient step gives it. Returns False, changing nothing, for
    any other optimizer or one that already has state; a later ``step()`` then behaves as
    an optimizer's first."""
    if type(optimizer) not in _PRIMED or optimizer.state:
        return False
    groups = optimizer.param_groups
    if not all({"fused", "capturable", "amsgrad"} <= g.keys() for g in groups):
        return False
    for g in groups:
        on_device = bool(g["capturable"] or g["fused"])
        for p in g["params"]:
            if not p.requires_grad:
                continue
            state = optimizer.state[p]
            state["step"] = (torch.zeros((), dtype=adam_step_dtype(fused=g["fused"]),
                                         device=p.device) if on_device
                             else torch.tensor(0.0, dtype=adam_step_dtype(), device="cpu"))
            names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ())
            for name in names:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True


def _supported(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the renaming can be reused: not for FSDP1 (its own state-dict machinery) or
    optimizers whose ``state_dict`` is not the base class's id-keyed one."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return False
    if optimizer is None:
        return True
    return (type(optimizer).state_dict is torch.optim.Optimizer.state_dict
            and not hasattr(optimizer, "optimizers"))


def _params(optimizer: torch.optim.Optimizer) -> Any:
    return chain.from_iterable(g["params"] for g in optimizer.param_groups)


def _has_grads(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for p in _params(optimizer))


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` hold the same keys in the same order and the same tensors (by
    storage and layout, not value) and equal other values."""
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and list(a) == list(b) and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and _layout(a) == _layout(b)
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    extra: tuple[Any, ...] = ()
    if isinstance(t, DTensor):
        extra = (t.device_mesh, t.placements)
        t = t.to_local()
    return (type(t), t.dtype, t.device, tuple(t.shape), t.stride(), t.data_ptr(), *extra)
