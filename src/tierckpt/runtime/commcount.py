"""Count what a save or a restore asks of the communication layer: collectives by kind, and
the pickled bytes each rank sends and receives through them.

:class:`CommCounter` is a context manager that wraps the ``torch.distributed`` collectives
DCP and tierckpt call (object collectives and tensor collectives alike) for as long as it is
open, in this process. It counts, it does not time: on shared machines counts are the
structural measure of whether a path grows with the number of ranks. Object sizes are the
pickled sizes of the Python objects (what gloo carries, less its framing); a tensor
collective counts the tensor's bytes. Not thread-safe across two counters; one at a time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "scatter_object_list",
                      "broadcast_object_list")
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "gather", "scatter", "barrier",
                      "reduce_scatter_tensor", "all_gather_into_tensor")


def _size(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    try:
        return len(pickle.dumps(obj))
    except Exception:  # an object that does not pickle here was not sent by pickle either
        return 0


@dataclasses.dataclass
class Counts:
    """This rank's collectives by kind, and the bytes it sent and received through them."""

    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    sent: int = 0
    received: int = 0

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def to_json(self) -> dict[str, Any]:
        return {"collectives": self.total, "by_kind": dict(self.calls), "sent": self.sent,
                "received": self.received}


class CommCounter:
    """``with CommCounter() as c: ckpt.save(...)`` — ``c.counts`` afterwards."""

    def __init__(self) -> None:
        self.counts = Counts()
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> CommCounter:
        for name in (*OBJECT_COLLECTIVES, *TENSOR_COLLECTIVES):
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self._count(name, args, kwargs)
            return out
        return counted

    def _count(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        c = self.counts
        c.calls[name] += 1
        rank = dist.get_rank(kwargs.get("group")) if dist.is_initialized() else 0
        if name == "all_gather_object":
            out = args[0] if args else kwargs["object_list"]
            sizes = [_size(o) for o in out]
            c.sent += sizes[rank] if rank < len(sizes) else 0
            c.received += sum(sizes)
        elif name == "gather_object":
            obj = args[0] if args else kwargs["obj"]
            out = args[1] if len(args) > 1 else kwargs.get("object_gather_list")
            c.sent += _size(obj)
            if out is not None:
                c.received += sum(_size(o) for o in out)
        elif name == "scatter_object_list":
            out = args[0] if args else kwargs["scatter_object_output_list"]
            src = args[1] if len(args) > 1 else kwargs.get("scatter_object_input_list")
            c.received += sum(_size(o) for o in out)
            if src is not None:
                c.sent += sum(_size(o) for o in src)
        elif name == "broadcast_object_list":
            objs = args[0] if args else kwargs["object_list"]
            n = sum(_size(o) for o in objs)
            c.received += n
        else:
            t = args[0] if args else next(iter(kwargs.values()), None)
            n = sum(_size(x) for x in t) if isinstance(t, list) else \
                _size(t) if isinstance(t, torch.Tensor) else 0
            c.sent += n
            c.received += n


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """``with counting() as counts:`` — the :class:`Counts` of what ran inside."""
    with CommCounter() as c:
        yield c.counts
