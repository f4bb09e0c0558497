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
from typing import Any

import torch.distributed as dist

from tierckpt.errors import LockError


@dataclasses.dataclass
class Comm:
    """Rank, world size and the checkpoint group (None when not distributed)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @classmethod
    def create(cls, timeout_s: float) -> Comm:
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), group)

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
            return dist.distributed_c10d._get_default_store().clone()  # type: ignore[attr-defined]
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

