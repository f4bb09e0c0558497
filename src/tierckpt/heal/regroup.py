"""Re-form the default process group after a peer died, in the processes that survived it
(step 3 of a heal, docs/heal.md), and tell the heal launcher when a generation is whole.

Only for a job started by ``tierckpt run --heal`` (:mod:`tierckpt.runtime.healenv`): the
launcher opens generation g + 1 when it sees a worker die, starts the replacement in it, and
each survivor, after the failed collective, calls :func:`regroup`: it destroys every process
group of its generation (their keys are never read again), waits for the launcher's next
generation, and joins it with the same rank and world size under that generation's store
prefix. FSDP2 modules keep working across it: their device mesh finds its group by name, and
a re-formed default group gets the old one's name (checked on torch 2.13, gloo). A DDP
wrapper held its group: it is emptied, and the module must be wrapped again. What a heal
resets of FSDP2 and DDP themselves is torch internals: :mod:`tierckpt._torch.fsdp2`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass

import torch.distributed as dist

from tierckpt.errors import HealError
from tierckpt.runtime import steps
from tierckpt.runtime.distributed import Joined, joined

_POLL_S = 0.01


@dataclass(frozen=True)
class Regrouped:
    """One re-formation: the generation joined, the ranks it replaced, the seconds spent
    waiting for the launcher to open it and forming its group."""

    gen: int
    dead: tuple[int, ...]
    wait_s: float
    form_s: float


def healing() -> Joined | None:
    """The joined group when this process may heal (started by the heal launcher), else None."""
    j = joined()
    return j if j is not None and j.heal is not None else None


def regroup() -> Regrouped:
    """Leave this generation's groups and join the launcher's next one (collective with the
    other survivors and the replacement). Bounded by the heal timeout for the launcher's
    answer and by the group's own timeout for the others to join. Raises HealError when
    this process was not started by the heal launcher or no next generation came."""
    j = healing()
    if j is None or j.heal is None:
        raise HealError("this process was not started by `tierckpt run --heal`: it cannot "
                        "heal; let it exit and the launcher restart the job")
    heal = j.heal
    t0 = time.monotonic()
    with contextlib.suppress(Exception):  # a group with a dead member may fail to tear down
        dist.destroy_process_group()  # every group of the old generation, ours included
    gen = _next_generation(j)
    dead = replaced(gen)
    if j.rank in dead:  # replaced: its node was taken for lost, and another runs this rank
        raise HealError(f"rank {j.rank} was replaced in generation {gen} (its node was seen "
                        "lost or it was taken for stuck): this process must exit")
    t1 = time.monotonic()
    dist.init_process_group(backend=j.backend, store=dist.PrefixStore(heal.pg_prefix(gen),
                                                                       j.store),
                            rank=j.rank, world_size=j.world_size, timeout=j.timeout)
    j.heal = dataclasses.replace(heal, gen=gen)
    return Regrouped(gen=gen, dead=dead, wait_s=t1 - t0, form_s=time.monotonic() - t1)


def _next_generation(j: Joined) -> int:
    assert j.heal is not None
    key, deadline = j.heal.key("gen"), time.monotonic() + j.heal.timeout_s
    while True:
        if j.store.check([key]):
            gen = int(j.store.get(key))
            if gen > j.heal.gen:
                return gen
        if time.monotonic() > deadline:
            raise HealError(f"rank {j.rank}: the launcher opened no generation after "
                            f"{j.heal.gen} within {j.heal.timeout_s:.0f} s (no rank died, or "
                            "the launcher is gone): not a peer's failure, or not healable")
        time.sleep(_POLL_S)


def mark_ready() -> None:
    """Count this rank's state as loaded in its generation (the launcher heals a later
    death only once every rank of the generation has counted). No-op outside the heal
    launcher."""
    j = healing()
    if j is not None and j.heal is not None:
        j.store.add(j.heal.key(f"ready/{j.heal.gen}"), 1)


def replaced(gen: int) -> tuple[int, ...]:
    """The ranks the launcher replaced in generation ``gen`` (``dead/<g>``: the dead, and
    any survivor it found stuck and replaced too — so read it again once the generation has
    formed for the final list)."""
    j = healing()
    assert j is not None and j.heal is not None
    return tuple(int(r) for r in json.loads(j.store.get(j.heal.key(f"dead/{gen}"))))


def mark_left() -> None:
    """Tell the launcher this survivor is leaving its failed generation (its heal began);
    one that does not say so in time is replaced. No-op outside the heal launcher."""
    j = healing()
    if j is not None and j.heal is not None:
        j.store.set(j.heal.key(f"left/{j.heal.gen}/{j.rank}"), "1")
        j.store.add(j.heal.key(f"leaving/{j.heal.gen}"), 1)  # what a spare node reads


def mark_stepped() -> None:
    """Count this rank's first completed step in its generation (the launcher replaces the
    spares a heal took once every rank has counted). No-op outside the heal launcher.
    Called through :func:`tierckpt.runtime.steps.on_first_step` (registered below)."""
    j = healing()
    if j is not None and j.heal is not None:
        j.store.add(j.heal.key(f"stepped/{j.heal.gen}"), 1)


steps.on_first_step(mark_stepped)  # the manager imports this module: every job registers it
