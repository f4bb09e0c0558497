"""How a :class:`~tierckpt.TrainState` reads and writes the model and optimizer state: the
:class:`ModelState` protocol, the public seam an integration implements when its model or
optimizer is not one ``nn.Module`` and one ``torch.optim.Optimizer`` (torchtitan's model
parts and optimizers container), and :class:`TorchModelState`, the default.

The per-rank part of the state (RNG streams, scheduler, data loader, ``extra``) is always
the TrainState's own; a ``ModelState`` supplies only the two dicts that DCP saves under
``"model"`` and ``"optim"``, applies them after a load, and names the tensors that
``optimizer.step()`` writes (what overlapped staging may copy after ``save()`` returns).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from tierckpt.state_capture import StateCapture, StateDicts


@runtime_checkable
class ModelState(Protocol):
    """The model and optimizer state of one rank, as DCP saves and loads it."""

    def state_dicts(self) -> StateDicts:
        """``(model, optim)``: live tensors under canonical FQNs, the same keys on every
        rank and at every save while the layout does not change (``optim`` is ``{}``
        without an optimizer)."""
        ...

    def load_state_dicts(self, model: dict[str, Any], optim: dict[str, Any] | None) -> None:
        """Apply loaded dicts shaped like :meth:`state_dicts` (``optim`` None: none saved
        or no optimizer), strictly: a missing or unexpected key is an error."""
        ...

    def step_tensors(self) -> Iterator[torch.Tensor]:
        """The tensors ``optimizer.step()`` writes in place: parameters and optimizer state."""
        ...


class TorchModelState:
    """The default: one module (plain, DDP or FSDP2) and one optimizer (or none), through
    ``torch.distributed.checkpoint.state_dict`` (the keys derived once, see
    :class:`~tierckpt.state_capture.StateCapture`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.capture = StateCapture(model, optimizer)

    def state_dicts(self) -> StateDicts:
        return self.capture()

    def load_state_dicts(self, model: dict[str, Any], optim: dict[str, Any] | None) -> None:
        opt: Any = self.optimizer if self.optimizer is not None else ()
        optim_sd: Any = optim if self.optimizer is not None and optim is not None else {}
        set_state_dict(self.model, opt, model_state_dict=model, optim_state_dict=optim_sd,
                       options=StateDictOptions(strict=True))

    def step_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.model.parameters()
        yield from optimizer_tensors(self.optimizer)


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """The tensors of an optimizer's per-parameter state (an optimizer container's inner
    optimizers' too); nothing for None."""
    todo: list[Any] = [optimizer]
    while todo:
        opt = todo.pop()
        for per_param in getattr(opt, "state", {}).values():
            if isinstance(per_param, Mapping):
                yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))
        todo.extend(getattr(opt, "optimizers", ()))
