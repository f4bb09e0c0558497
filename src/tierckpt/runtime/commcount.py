"""Count what a save or a restore asks of the communication layer: collectives by kind, and
the pickled bytes each rank sends and receives through them.

:class:`CommCounter` is a context manager that wraps the ``torch.distributed`` collectives
DCP and tierckpt call (object collectives and tensor collectives alike) for as long as it is
open, in this process, on every thread (tierckpt's saver thread included). It counts, it
does not time: on shared machines counts are the structural measure of whether a path grows
with the number of ranks.

What a byte is: an object's pickled size (what gloo carries, less its framing); a tensor's
``numel × element_size``. Per call, on this rank:

- ``sent``: what this rank puts on the wire — its own contribution once, however many peers
  receive it (an all-gather, a gather from a non-destination), or the other ranks' entries
  (a scatter source), or the payload (a broadcast source). Its own entry of a gather or
  scatter stays local and is not counted.
- ``received``: what other ranks' contributions bring here — the others' objects of an
  all-gather, everything a gather's destination collects from the others, this rank's
  entry of a scatter, the payload of a broadcast (not at its source).
- ``all_reduce`` counts the tensor both ways (each rank contributes it and gets the
  result back); ``barrier`` counts a call and no bytes.

Only calls through the ``torch.distributed`` module's attributes are seen (how DCP's
``_DistWrapper`` and tierckpt's ``Comm`` call them); the collectives an object collective
runs inside ``distributed_c10d`` are not counted again. One counter at a time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "scatter_object_list",
                      "broadcast_object_list")
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "gather", "scatter", "barrier",
                      "reduce_scatter_tensor", "all_gather_into_tensor")


def _size(obj: Any) -> int:
    """Bytes ``obj`` takes on the wire: a tensor's data, anything else pickled."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    try:
        return len(pickle.dumps(obj))
    except Exception:  # an object that does not pickle here was not sent by pickle either
        return 0


def _others(objs: Any, me: int) -> int:
    """Bytes of the entries of ``objs`` other than this rank's (index ``me``); its own
    entry is not re-measured from the copy, whose pickle can differ in size."""
    return sum(_size(o) for i, o in enumerate(objs) if i != me) if objs is not None else 0


@dataclasses.dataclass
class Counts:
    """This rank's collectives by kind, and the bytes it sent and received through them
    (see the module docstring for what counts as sent and received)."""

    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    sent: int = 0
    received: int = 0

    @property
    def total(self) -> int:
        """Collectives of every kind."""
        return sum(self.calls.values())

    def to_json(self) -> dict[str, Any]:
        """``{"collectives", "by_kind", "sent", "received"}``; bytes as ints."""
        return {"collectives": self.total, "by_kind": dict(self.calls), "sent": self.sent,
                "received": self.received}


def _is_root(a: dict[str, Any], global_key: str, group_key: str) -> bool:
    """Whether this rank is the call's source or destination (``src``/``dst`` are global
    ranks, ``group_src``/``group_dst`` ranks in ``group``; neither given means rank 0)."""
    if a.get(group_key) is not None:
        return bool(dist.get_rank(a.get("group")) == a[group_key])
    if a.get(global_key) is not None:
        return bool(dist.get_rank() == a[global_key])
    return bool(dist.get_rank(a.get("group")) == 0)


def _bytes(name: str, a: dict[str, Any]) -> tuple[int, int]:
    """``(sent, received)`` by this rank for one finished call with bound arguments ``a``."""
    me = dist.get_rank(a.get("group")) if dist.is_initialized() else 0
    if name in ("all_gather_object", "all_gather", "all_gather_into_tensor"):
        own = _size(a.get("obj", a.get("tensor", a.get("input_tensor"))))
        out = a.get("object_list", a.get("tensor_list"))
        if out is None:  # one flat output tensor: the others' part is the rest of it
            return own, _size(a["output_tensor"]) - own
        return own, _others(out, me)
    if name in ("gather_object", "gather"):
        own = _size(a.get("obj", a.get("tensor")))
        if not _is_root(a, "dst", "group_dst"):
            return own, 0
        return 0, _others(a.get("object_gather_list", a.get("gather_list")), me)
    if name in ("scatter_object_list", "scatter"):
        out = a.get("scatter_object_output_list")
        mine = sum(_size(o) for o in out) if out is not None else _size(a["tensor"])
        if not _is_root(a, "src", "group_src"):
            return 0, mine
        return _others(a.get("scatter_object_input_list", a.get("scatter_list")), me), 0
    if name in ("broadcast_object_list", "broadcast"):
        objs = a.get("object_list")
        n = sum(_size(o) for o in objs) if objs is not None else _size(a["tensor"])
        return (n, 0) if _is_root(a, "src", "group_src") else (0, n)
    if name == "all_reduce":
        n = _size(a["tensor"])
        return n, n
    if name == "reduce_scatter_tensor":
        return _size(a["input"]), _size(a["output"])
    return 0, 0  # barrier


class CommCounter:
    """``with CommCounter() as c: ckpt.save(...)`` — ``c.counts`` afterwards.

    While open, the wrapped ``torch.distributed`` functions count each call after it
    returned (a call that raised is not counted). Thread-safe for the calls it counts;
    opening two counters at once is not supported."""

    def __init__(self) -> None:
        self.counts = Counts()
        self._saved: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()

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
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self._count(name, sig.bind(*args, **kwargs).arguments)
            return out
        return counted

    def _count(self, name: str, arguments: dict[str, Any]) -> None:
        sent, received = _bytes(name, arguments)
        with self._lock:
            self.counts.calls[name] += 1
            self.counts.sent += sent
            self.counts.received += received


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """``with counting() as counts:`` — the :class:`Counts` of what ran inside."""
    with CommCounter() as c:
        yield c.counts
