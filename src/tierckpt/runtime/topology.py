"""Who shares which tier-1 root, and the checkpoint process group.

Ranks that see the same tier-1 directory form a *domain* (one node with node-local disks,
or the whole job on a shared file system); the lowest rank of a domain is its *owner* and
does the domain's commit, cleanup and retention. Domains are found by probing, not assumed:
every rank drops a uniquely named probe file into its root and reads which probes it sees.

All collectives here run on a dedicated gloo group with its own timeout, so background
checkpoint traffic never interleaves with the training job's collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import uuid
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tierckpt._torch.core import default_store
from tierckpt.errors import LockError

T = TypeVar("T")


@dataclasses.dataclass
class Comm:
    """Rank, world size and the checkpoint group (None when not distributed)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    timeout_s: float = 300.0

    @classmethod
    def create(cls, timeout_s: float) -> Comm:
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), group, timeout_s)

    def subgroup(self, ranks: tuple[int, ...]) -> Comm | None:
        """Collective (every rank calls it with the same ``ranks``): a Comm over ``ranks``
        (sorted global ranks; its collectives take global ranks as ``src``), or None on a
        rank outside them — and everywhere when not distributed or ``ranks`` is one rank."""
        if self.group is None or len(ranks) < 2:
            return None
        group = dist.new_group(ranks=sorted(ranks), backend="gloo",
                               timeout=datetime.timedelta(seconds=self.timeout_s))
        if self.rank not in ranks:
            return None
        return Comm(self.rank, len(ranks), group, self.timeout_s)

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` at ``dst`` (in rank order); None elsewhere. O(1) sent per
        rank, O(W) received at ``dst`` only."""
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.group)
        return out

    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any:
        """``objs[r]`` (given on ``src``) to rank r."""
        if self.group is None:
            assert objs is not None
            return objs[0]
        box: list[Any] = [None]
        dist.scatter_object_list(box, objs if self.rank == src else None, src=src,
                                 group=self.group)
        return box[0]

    def first_error(self, error: T | None) -> T | None:
        """Collective: the lowest rank's ``error`` (any picklable value; None: no error) if
        any rank has one, else None, on every rank. One all-reduce of a flag when nobody
        failed (O(1) per rank); the errors are gathered only when one did."""
        if self.group is None:
            return error
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return None
        errors = self.gather(error)
        first = next((e for e in errors if e is not None), None) if errors is not None else None
        result: T | None = self.broadcast(first)
        return result

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def store(self) -> Any:
        """A private connection to the job's store (a clone of the default group's), for a
        thread that must not share the training thread's socket; None when not distributed
        or the store cannot be cloned."""
        if self.group is None:
            return None
        try:
            return default_store().clone()
        except (RuntimeError, AttributeError, ValueError):
            return None

    def barrier(self) -> None:
        if self.group is not None:
            self.all_gather(None)

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
            self.group = None


def discover_domains(root: Path, comm: Comm) -> tuple[tuple[int, ...], ...]:
    """Group ranks by the tier-1 directory they see (collective). Sorted, disjoint."""
    run = comm.broadcast(uuid.uuid4().hex if comm.rank == 0 else None)
    probe = root / f".probe-{run}-{comm.rank}"
    probe.touch()
    try:
        comm.barrier()
        prefix = f".probe-{run}-"
        mine = tuple(sorted(int(p.name[len(prefix):]) for p in root.iterdir()
                            if p.name.startswith(prefix)))
        views = comm.all_gather(mine)
    finally:
        comm.barrier()
        probe.unlink(missing_ok=True)
    domains = tuple(sorted(set(views)))
    covered = sorted(r for d in domains for r in d)
    if covered != list(range(comm.world_size)):
        raise LockError(f"ranks disagree on which tier-1 roots they share: {views}")
    return domains

