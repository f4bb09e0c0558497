"""DCP's save protocol, run so that a rank's cost does not grow with the number of ranks.

``dcp.save`` does four collectives per save, two of them O(W) on *every* rank: it gathers
every rank's local plan to the coordinator and scatters the global plans back (the central
plan, rebuilt and re-validated at every save), and after the write it gathers the write
results and **broadcasts the whole global** ``Metadata`` **to every rank**. This module runs
the same protocol (``StorageWriter``/``SavePlanner`` calls in DCP's order, the files
byte-for-byte the same, ``dcp.load`` reads them) with:

- **a global plan without O(W²) work** when one is built (:mod:`tierckpt._torch.planner`).
- **a cached plan.** The state's layout does not change between saves, so each rank
  fingerprints its local plan; one all-reduce of a flag says whether any rank's changed.
  Only then are plans gathered and the global plan rebuilt (the first save, or a new
  layout). Otherwise each rank reuses its cached central plan, and the coordinator its
  cached metadata skeleton (``storage_data`` is filled from this save's results).
- **each rank's own metadata.** Every rank writes ``__<rank>.metadata`` (its items only,
  :func:`rank_metadata`) beside its shards, so a restore on the same layout reads O(1)
  metadata per rank instead of the global ``.metadata`` (which is still written), and
  ``__<rank>.records`` with its records' CRC32Cs, which the manifest no longer lists
  inline (it lists a few files per rank, so the file list sent to the coordinator is
  O(1) per rank).
- **results to the coordinator only.** Write results and this rank's file list go to the
  coordinator (a gather: O(1) sent per rank). Nothing O(W) comes back: the caller decides
  what the others need (the saver sends the manifest to the domain owners only).

- **the same ``.metadata``.** With the plan cached, a rank's write results (records,
  offsets, lengths) are those of its previous save: it sends their digest instead, and when
  no rank's changed the coordinator writes the previous ``.metadata`` bytes again instead
  of rebuilding and pickling O(W × tensors) of it (:attr:`PlanCache.reused`).
  Each rank also says which ``.metadata`` it holds (``held``: the SHA-256 of the bytes a
  domain owner last committed), so the caller sends those O(W × tensors) bytes to the
  owners only when one of them does not hold them.

Collectives per save, every rank: 1 all-reduce (the plan check), 1 gather (results), and
with a changed layout 1 gather + 1 scatter more. A failed write on any rank fails the save
on every rank (:func:`first_error` of the caller).
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt._torch.planner import SavePlanner
from tierckpt.format.manifest import FileEntry
from tierckpt.runtime.topology import Comm
from tierckpt.save.writer import ShardWriter


@dataclasses.dataclass
class PlanCache:
    """One rank's cached plan: its local plan's fingerprint, its central plan, and (on
    the coordinator) the global metadata skeleton. ``plans``: how many times the global
    plan was built (1 while the layout stays the same)."""

    fingerprint: bytes = b""
    central: SavePlan | None = None
    metadata: Metadata | None = None
    plans: int = 0
    sent: bytes = b""
    """Digest of the write results this rank last sent whole (cleared when a save fails)."""
    results: dict[int, tuple[bytes, list[WriteResult]]] = dataclasses.field(
        default_factory=dict)
    """Coordinator: each rank's last write results received, with their digest."""
    metadata_bytes: bytes | None = None
    """Coordinator: the last ``.metadata`` written, reused while no rank's results changed."""
    reused: int = 0
    """Saves whose ``.metadata`` was the previous one's bytes (no rank's results changed)."""


@dataclasses.dataclass(frozen=True)
class Written:
    """What a rank wrote (``files``, ``error``); on the coordinator also every rank's files
    and errors in rank order, and whether the global plan was rebuilt."""

    files: list[FileEntry]
    error: str | None
    exception: BaseException | None = None
    all_files: list[list[FileEntry]] | None = None
    all_errors: list[str | None] | None = None
    all_held: list[bytes | None] | None = None
    """Coordinator: the ``held`` each rank passed, in rank order."""
    replanned: bool = False


def _digest(results: list[WriteResult]) -> bytes:
    return hashlib.sha256(pickle.dumps(results, protocol=5)).digest()


def _fingerprint(plan: SavePlan) -> bytes:
    return hashlib.sha256(pickle.dumps(plan.items, protocol=5)).digest()


def _changed_anywhere(comm: Comm, changed: bool) -> bool:
    if comm.group is None:
        return changed
    flag = torch.tensor([1 if changed else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.group)
    return bool(flag.item())


def rank_metadata(local: SavePlan, results: list[WriteResult]) -> Metadata:
    """DCP ``Metadata`` of one rank's own items: every key of its local plan (before the
    coordinator de-duplicated replicated items) with this rank's chunks, and the storage of
    the records it wrote (``results``). A restore on the saved layout plans its reads from
    it alone when it covers the rank's state (:func:`tierckpt.restore.loader.load_into`);
    an item another rank wrote (a replicated tensor) is not covered here. O(items of this
    rank): it does not grow with the number of ranks."""
    _, md = create_default_global_save_plan([local], rewrite_index_hints=False)
    md.planner_data = local.planner_data
    md.storage_data = {wr.index: wr.storage_data for wr in results}
    return md


def save(state_dict: dict[str, Any], writer: ShardWriter, comm: Comm,
         cache: PlanCache, held: bytes | None = None) -> Written:
    """Collective: write ``state_dict`` through ``writer`` (see the module docstring).
    The coordinator also writes ``.metadata`` (``writer.finish``) when every rank wrote its
    shards. ``held`` (32 bytes or None) reaches the coordinator in ``Written.all_held``.
    Errors are returned, not raised, so every rank reaches the same collectives."""
    coordinator = comm.rank == 0
    planner = SavePlanner()
    planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                           is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, rank=comm.rank, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    replan = _plan_centrally(comm, planner, writer, local, cache)
    results, error, exc = _write(writer, planner, cache, local, comm.rank)
    # the same plan writes the same records at the same offsets: a rank whose results did
    # not change since it last sent them sends their digest only (O(1) per rank)
    digest = _digest(results)
    same = error is None and not replan and digest == cache.sent
    gathered = comm.gather((digest, None if same else results, writer.files, error, held))
    cache.sent = digest if error is None else b""
    if not coordinator:
        return Written(files=writer.files, error=error, exception=exc, replanned=replan)
    assert gathered is not None and cache.metadata is not None
    errors = [g[3] for g in gathered]
    all_results, changed = _results(gathered, cache, errors)
    if not any(errors):
        try:
            _finish(writer, cache, all_results, changed=changed)
        except Exception as e:
            errors[0] = f"rank 0: writing .metadata: {type(e).__name__}: {e}"
            exc = exc or e
    return Written(files=writer.files, error=error or next((e for e in errors if e), None),
                   exception=exc, all_files=[g[2] for g in gathered], all_errors=errors,
                   all_held=[g[4] for g in gathered], replanned=replan)


def _plan_centrally(comm: Comm, planner: SavePlanner, writer: ShardWriter, local: SavePlan,
                    cache: PlanCache) -> bool:
    """Collective: when any rank's local plan changed (or none is cached), gather the
    plans, let the coordinator build the global plan and metadata, and scatter each rank
    its part into ``cache``; returns whether it did."""
    fp = _fingerprint(local)
    replan = _changed_anywhere(comm, cache.central is None or fp != cache.fingerprint)
    if replan:
        plans = comm.gather(local)
        scattered: list[SavePlan] | None = None
        if comm.rank == 0:
            assert plans is not None
            global_plans, metadata = planner.create_global_plan(plans)
            scattered = writer.prepare_global_plan(global_plans)
            cache.metadata = metadata
        central = comm.scatter(scattered)
        cache.fingerprint, cache.central = fp, central
        cache.plans += 1
    assert cache.central is not None
    return replan


def _write(writer: ShardWriter, planner: SavePlanner, cache: PlanCache, local: SavePlan,
           rank: int) -> tuple[list[WriteResult], str | None, BaseException | None]:
    """This rank's shards, its own metadata and records: (the write results, the error as
    reported to every rank, the exception). An error is returned, not raised."""
    assert cache.central is not None
    results: list[WriteResult] = []  # those of a write whose metadata failed are sent too
    try:
        fut = writer.write_data(planner.finish_plan(cache.central), planner)
        fut.wait()
        results = fut.value()
        writer.write_rank_metadata(rank_metadata(local, results))
        writer.write_rank_records()
    except Exception as e:  # reported through the gather: every rank fails together
        return results, f"rank {rank}: {type(e).__name__}: {e}", e
    return results, None, None


def _finish(writer: ShardWriter, cache: PlanCache, all_results: list[list[WriteResult]], *,
            changed: bool) -> None:
    """Coordinator: write ``.metadata``; rebuilt when any rank's results changed, else the
    cached bytes again (O(1))."""
    assert cache.metadata is not None
    if changed or cache.metadata_bytes is None:
        writer.finish(metadata=cache.metadata, results=all_results)
        cache.metadata_bytes = writer.metadata_bytes
    else:  # nothing changed anywhere: the same .metadata, not rebuilt
        writer.finish_bytes(cache.metadata_bytes)
        cache.reused += 1


def _results(gathered: list[Any], cache: PlanCache, errors: list[str | None]
             ) -> tuple[list[list[WriteResult]], bool]:
    """Coordinator: every rank's write results (those sent as a digest from the cache) and
    whether any rank sent new ones. A digest with no cached results to match (the cache
    was lost) is an error of that rank's: the save fails and every rank sends in full
    next time."""
    out: list[list[WriteResult]] = []
    changed = False
    for r, (digest, results, *_) in enumerate(gathered):
        if results is not None:
            cache.results[r] = (digest, results)
            changed = True
        elif cache.results.get(r, (b"", []))[0] != digest:
            errors[r] = errors[r] or (f"rank {r}: sent the digest of write results the "
                                      "coordinator does not hold (it resends them next save)")
            cache.results.pop(r, None)
        out.append(cache.results.get(r, (b"", []))[1])
    return out, changed or len(cache.results) != len(gathered)
