"""Re-form the default process group after a peer died, in the processes that survived it
(step 3 of a heal, docs/heal.md), and tell the heal launcher when a generation is whole.

Only for a job started by ``tierckpt run --heal`` (:mod:`tierckpt.runtime.healenv`): the
launcher opens generation g + 1 when it sees a worker die, starts the replacement in it, and
each survivor, after the failed collective, calls :func:`regroup`: it destroys every process
group of its generation (their keys are never read again), waits for the launcher's next
generation, and joins it with the same rank and world size under that generation's store
prefix. FSDP2 modules keep working across it: their device mesh finds its group by name, and
a re-formed default group gets the old one's name (checked on torch 2.13, gloo). A DDP
wrapper held its group: it is emptied, and the module must be wrapped again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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
    t1 = time.monotonic()
    dist.init_process_group(backend=j.backend, store=dist.PrefixStore(heal.pg_prefix(gen),
                                                                       j.store),
                            rank=j.rank, world_size=j.world_size, timeout=j.timeout)
    j.heal = dataclasses.replace(heal, gen=gen)
    return Regrouped(gen=gen, dead=dead, wait_s=t1 - t0, form_s=time.monotonic() - t1)


def detach(model: object) -> None:
    """Let the failed generation's groups go now, so their sockets close and the survivors
    still waiting in a collective with this rank fail at once: in gloo's ring a rank two
    places from the dead one waits on a live neighbour, and neither an abort (torch 2.13:
    it does not wake a pending receive) nor a destroyed group whose object is still
    referenced ends that wait before the timeout — only the neighbour's closed socket does.
    So: destroy every group, forget the failed step's collectives and FSDP2's cached
    references to the groups (:func:`rebind_fsdp` sets new ones), drop every gradient of
    the failed step (a loop that zeroes them after ``optimizer.step()`` would add them to
    the next step's), and collect garbage. The caller clears the failed step's frames
    first. A DDP wrapper of ``model`` (or ``model`` itself) is emptied of its group, its
    reducer and the reducer's logger, which held the group: it is unusable afterwards, and
    the heal's ``rebuild`` wraps the module again."""
    fsdp = _fsdp_modules(model)
    if not fsdp:  # no DDP wraps an FSDP2 model, and the search costs ~0.06 s of the heal
        _release_ddp(model)
    with contextlib.suppress(Exception):  # a group with a dead member may fail to tear down
        dist.destroy_process_group()
    for mesh_info in _fsdp_mesh_infos(fsdp).values():
        for name in ("shard_process_group", "replicate_process_group",
                     "reduce_scatter_process_group"):
            if hasattr(mesh_info, name):
                setattr(mesh_info, name, None)
        for mesh in _meshes(mesh_info):
            mesh._pg_registry = {}  # the mesh's own references (for torch.compile)
    for module in fsdp:
        _forget_the_failed_step(module._get_fsdp_state())  # its results hold the groups
    if hasattr(model, "parameters"):
        for param in model.parameters():
            param.grad = None
    gc.collect()


def _release_ddp(model: object) -> None:
    """Drop every reference a DDP wrapper of ``model`` holds to its process group. Without
    this a survivor two places from the dead rank in gloo's ring waited at world 4 until the
    launcher replaced it as stuck (12.8 s instead of a heal's ~0.5 s)."""
    for ddp in _ddp_wrappers(model):
        for name in ("reducer", "logger", "process_group", "device_mesh"):
            if name in ddp.__dict__:
                ddp.__dict__[name] = None


def _ddp_wrappers(model: object) -> list[Any]:
    """The DDP wrappers of ``model`` (``model`` itself when it is one): the training loop,
    not tierckpt, holds them, so they are found among ``model``'s referrers — the wrapper's
    ``_modules`` dict, its ``__dict__``, the wrapper: three scans of the heap, not one walk
    over every live object (0.06 s against 0.15 s with torch imported)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return [model]
    frontier: list[Any] = [model]
    for _ in range(3):
        refs = gc.get_referrers(*frontier)
        found = [r for r in refs if isinstance(r, DistributedDataParallel)
                 and r.module is model]
        frontier = [r for r in refs if isinstance(r, dict)]
        if found or not frontier:
            return found
    return []


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


def mark_stepped() -> None:
    """Count this rank's first completed step in its generation (the launcher replaces the
    spares a heal took once every rank has counted). No-op outside the heal launcher.
    Called through :func:`tierckpt.runtime.steps.on_first_step` (registered below)."""
    j = healing()
    if j is not None and j.heal is not None:
        j.store.add(j.heal.key(f"stepped/{j.heal.gen}"), 1)


steps.on_first_step(mark_stepped)  # the manager imports this module: every job registers it


def rebind_fsdp(model: object) -> int:
    """Point every FSDP2 module of ``model`` at the re-formed group; the number of FSDP2
    parameter groups rebound. FSDP2 resolves its device mesh's group by name, which a
    re-formed default group keeps, but caches the group object itself in its mesh infos
    (torch 2.13: ``FSDPMeshInfo.shard_process_group``); re-running their ``__post_init__``
    re-reads it (a separate reduce-scatter group is dropped: the shard group serves). Each
    module is also resharded, so nothing the failed step all-gathered stays unsharded, and
    the root gets ``FSDPModule.reset_iter_state()`` where torch has it (what it resets is
    reset here already — after the old group's results were dropped, which it would wait
    on — but a later torch may reset more). Raises HealError for a mesh of more than one
    dimension (HSDP, FSDP + TP): its sub-groups went with the old generation, and a full
    restart rebuilds them."""
    from torch import nn

    if not isinstance(model, nn.Module):
        return 0
    fsdp = _fsdp_modules(model)
    seen = _fsdp_mesh_infos(fsdp)
    for mesh_info in seen.values():
        if mesh_info.mesh.ndim != 1:
            raise HealError(f"an FSDP2 mesh of {mesh_info.mesh.ndim} dimensions cannot be "
                            "re-formed in place")
    for mesh_info in seen.values():
        for mesh in _meshes(mesh_info):
            mesh._pg_registry = {n: c10d._resolve_process_group(n)
                                 for n in getattr(mesh, "_dim_group_names", ())}
        mesh_info.__post_init__()  # re-reads the group from the mesh, by name
    for module in fsdp:
        state = module._get_fsdp_state()
        _forget_the_failed_step(state)
        module.reshard()
        if getattr(state, "_is_root", None) and hasattr(module, "reset_iter_state"):
            module.reset_iter_state()  # torch's own recovery (2.13+), for what it adds later
    return len(seen)


_STEP_RESULTS = ("_all_gather_result", "_post_reduce_event", "_reshard_after_forward_event",
                 "_partial_reduce_output", "_all_reduce_state")
"""An FSDP2 parameter group's results of collectives in flight (torch 2.13)."""


def _forget_the_failed_step(state: Any) -> None:
    """Reset what an FSDP2 module's state holds of a step that failed part-way: the
    training state, the root's iteration context, the results of collectives the old
    group had started — a prefetched all-gather left behind would be taken as done, and
    this rank would skip a collective the others make (a mismatch, seen at world 3) — the
    forward order the failed step recorded (the end of its backward would have cleared it:
    the next backward's last prefetch reads it, and the survivor all-gathered a layer the
    replacement did not, which hung the first step after the heal for the group's timeout),
    and every gradient of the step: those autograd had written to unsharded parameters whose
    post-backward never ran (the root's, when a later all-gather of the backward failed),
    which the next backward would add to — ``zero_grad`` clears only the sharded ones —
    and the sharded ones, which a loop zeroing them after ``optimizer.step()`` would add to
    the next step's. Either way the first update after the heal would be wrong."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state._training_state = TrainingState.IDLE
    ctx = state._state_ctx
    ctx.iter_forward_root, ctx.post_backward_final_callback_queued = None, False
    ctx.is_last_backward, ctx.post_optim_event = True, None
    for group in state._fsdp_param_groups:
        group._training_state = TrainingState.IDLE
        for name in _STEP_RESULTS:
            if hasattr(group, name):
                setattr(group, name, None)
        group._post_forward_indices.clear()
        for param in group.fsdp_params:
            param.unsharded_accumulated_grad = None
            param.sharded_param.grad = None  # not registered on the module while unsharded
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None
        for comm in {id(c): c for c in (group.comm_ctx, state._comm_ctx)}.values():
            comm.all_gather_state = None
            comm.reduce_scatter_states = []
            comm.post_forward_order.clear()  # the next backward's prefetches index it
            if hasattr(comm, "_last_post_reduce_events"):
                comm._last_post_reduce_events.clear()
    if hasattr(state, "_modules_to_run_forward"):
        state._modules_to_run_forward.clear()


def _fsdp_modules(model: object) -> list[Any]:
    """``model``'s FSDP2 modules (none when it is not a module)."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp_mesh_infos(modules: list[Any]) -> dict[int, Any]:
    """Every mesh info of these FSDP2 modules (parameter groups and parameters), by id."""
    seen: dict[int, Any] = {}
    for module in modules:
        state = module._get_fsdp_state()  # no public handle on the mesh infos
        for group in state._fsdp_param_groups:
            infos = [group.mesh_info, group.post_forward_mesh_info]
            infos += [p.mesh_info for p in group.fsdp_params]
            infos += [p.post_forward_mesh_info for p in group.fsdp_params]
            seen.update((id(i), i) for i in infos if i is not None)
    return seen


def _meshes(mesh_info: Any) -> list[Any]:
    """A mesh info's device mesh and its root mesh (each keeps a name → group registry)."""
    mesh = mesh_info.mesh
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return [m for m in {id(mesh): mesh, id(root): root}.values()
            if hasattr(m, "_pg_registry")]
