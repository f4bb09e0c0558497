"""FSDP2's and DDP's private state that a heal resets and rebinds (see the package's
table): a survivor lets the failed generation's groups go (:func:`detach`) and points its
FSDP2 modules at the re-formed group (:func:`rebind_fsdp`). Only
:mod:`tierckpt.heal.regroup` calls these, and only on a torch in
:data:`tierckpt._torch.TESTED` (a heal declines elsewhere)."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tierckpt.errors import HealError


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
