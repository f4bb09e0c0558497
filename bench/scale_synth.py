"""Synthetic planning at scale, in one process with no ranks: what a save's coordinator and a
restoring rank do with a Llama-70B-shaped state sharded W ways, for W up to thousands.

The state and each rank's ``SavePlan`` come from :mod:`bench.scale_state` (80 layers × 9
tensors, each with AdamW's two moments and ``step``, FSDP-sharded along dim 0), pickled as
``gather_object`` would send it. Then, timed phase by phase (seconds, perf_counter):

- the coordinator of DCP's default path: unpickle the W plans; ``dedup_save_plans``;
  ``create_default_global_save_plan``; merge the ``planner_data`` (``DefaultSavePlanner.
  _create_global_plan``'s body, phase by phase); ``_validate_global_plan``; pickle the W
  global plans for the scatter; unpickle the W write-result lists; build ``storage_data``
  and pickle the ``Metadata`` (the ``.metadata`` file; what ``ShardWriter.finish`` does);
- tierckpt's commit as ``save/saver.py`` did it up to fd5185e: unpickle the W file lists
  (an all-gather: every rank did this), build the ``Manifest`` (one ``FileEntry`` per rank
  file with a CRC ``Chunk`` per record, the ``.metadata`` entry, one domain per 8 ranks),
  ``to_bytes()`` and the marker;
- a restoring rank before the rank files (every rank): ``Manifest.from_bytes`` and
  tierckpt's safe unpickle of ``.metadata`` (``restore.metadata.load_metadata``);
- a rank since the rank files (``rank.*``): building its own ``__<rank>.metadata``
  (``save.coordinate.rank_metadata`` of rank 0's plan and write results) and
  ``__<rank>.records`` on save and, on a restore on the saved layout, unpickling the
  metadata instead of ``.metadata``; ``now.*``: a save's coordinator since (the plan
  cached and no rank's records changed: it unpickles W messages of a digest and three file
  entries — each rank's shard file without chunks and its two small files, rank 0's sizes
  for all —, builds the manifest and writes the previous ``.metadata`` bytes again: its
  seconds, peak and bytes received), and every restoring rank's parse of that manifest;
  ``now.parse_part``: since the manifest parts, a rank that is not its domain's owner
  checks its part against the marker instead (``format.parts.verify_part``).

Peak bytes: ``tracemalloc``'s peak over the coordinator's path (DCP then the manifest; the
received pickles themselves excluded), in a second pass so tracing does not slow the timed
one. Bytes on the wire are pickled sizes (see ``tierckpt.runtime.commcount``).

Scaling, labelled in the results: a point measures ``layers`` of the 80 (all 80 while
W × 80 ≤ ``item_cap``; fewer above, so memory and time stay bounded) and also 0 layers
(the param group and the W blobs alone; each phase the least of three passes); every
quantity is then ``v(0) + (v(L) − v(0)) × 80 / L`` — exact for sums over tensors, which
every phase is but two. The
``planner_data`` merge is W² lookups whose unit cost grows with the maps (cache misses):
it is measured on maps of the full state instead (:func:`_merge_full`). Validation is
timed per distinct tensor shape on one key each (``_validate_global_plan`` loops over keys
independently) and multiplied by the count of keys of that shape in the 80-layer state;
when that estimate is under ``validate_full_s`` and all 80 layers were built, the full
validation runs too and is reported as measured. Sizes scale exactly (within 3 % of the
full state, checked at W = 4 in the tests); a scaled time multiplies a difference timed
once by 80 / L, so at L = 1 (W = 4,096) read it to within tens of percent. ``raw`` keeps
both measured points.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import time
import tracemalloc
import zlib
from collections import ChainMap
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
)
from torch.distributed.checkpoint.storage import WriteResult

from bench.scale_state import LAYER, LAYERS, MOMENTS, local_plan, written
from tierckpt._torch.planner import merge_first_wins, validate_global_plan
from tierckpt.format import layout, records
from tierckpt.format import manifest as mf
from tierckpt.format.parts import seal, verify_part
from tierckpt.restore.metadata import load_metadata
from tierckpt.save.coordinate import rank_metadata
from tierckpt.tier1.manifests import MANIFEST_LIMIT

RANKS_PER_DOMAIN = 8
ITEM_CAP = 4096
"""Default ``item_cap``: the most W × layers a point builds (W ≤ 51 builds all 80 layers;
W = 4,096 one). About 100 s and 1.3 GB of this process per point at the cap."""
VALIDATE_FULL_S = 30.0


@dataclasses.dataclass
class _Wire:
    """What the ranks send the coordinator, pickled once and reused by both passes."""

    plans: list[bytes]
    stretch: float = 1.0
    results: list[bytes] | None = None
    files: list[bytes] | None = None


class _Clock:
    """Seconds per phase, in order: ``clock(name, fn, *args)`` runs and times ``fn``."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t
        return out


def _loads(blobs: list[bytes]) -> list[Any]:
    return [pickle.loads(b) for b in blobs]


def _merge_planner_data(md: Metadata, plans: list[SavePlan]) -> Metadata:
    return dataclasses.replace(md, planner_data=dict(ChainMap(*[p.planner_data
                                                                 for p in plans])))


def _finish(md: Metadata, results: list[list[WriteResult]]) -> bytes:
    """``ShardWriter.finish``: the storage data of every write result, then the pickle."""
    md.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
    return pickle.dumps(md)


def _unsealed(files: list[list[mf.FileEntry]], md_bytes: bytes, world: int) -> mf.Manifest:
    """The commit's manifest (``save/saver.py``) before its parts: the ranks' files, the
    ``.metadata`` entry, one domain per 8 ranks."""
    domains = tuple(tuple(range(d, min(world, d + RANKS_PER_DOMAIN)))
                    for d in range(0, world, RANKS_PER_DOMAIN))
    entry = mf.FileEntry(name=".metadata", size=len(md_bytes), crc32c=0, rank=None)
    return mf.Manifest(step=1000, world_size=world, save_id="synthetic", domains=domains,
                       files=(*(f for fl in files for f in fl), entry), created_unix=0.0)


def _manifest(files: list[list[mf.FileEntry]], md_bytes: bytes, world: int
              ) -> tuple[bytes, bytes]:
    """The manifest and marker as committed up to fd5185e (no parts)."""
    b = _unsealed(files, md_bytes, world).to_bytes()
    return b, mf.marker_bytes(b, 1000, "synthetic")


def _rank_files(rank: int, shard: mf.FileEntry, own: bytes, rec: bytes
                ) -> list[mf.FileEntry]:
    """What the manifest lists for a rank since the rank files: its shard file without
    chunks, its ``__<rank>.metadata`` and ``__<rank>.records`` (rank 0's sizes)."""
    def small(name: str, data: bytes) -> mf.FileEntry:
        crc = zlib.crc32(data)
        return mf.FileEntry(name=name, size=len(data), crc32c=crc, rank=rank)
    return [dataclasses.replace(shard, chunks=()),
            small(f"__{rank}.metadata", own), small(f"__{rank}.records", rec)]


def _coordinator_now(gathered: list[bytes], md_bytes: bytes, world: int
                     ) -> tuple[bytes, bytes, dict[str, bytes]]:
    """The coordinator of a cached save since the rank files (``save/coordinate.save``,
    ``save/saver.py``): unpickle each rank's (digest, no results, files, no error), check
    that no rank sent results, build the manifest and marker; ``.metadata`` is the previous
    save's bytes; the manifest's parts beside it. Returns the manifest, the marker and the
    parts."""
    msgs = _loads(gathered)
    assert all(m[1] is None for m in msgs)
    sealed = seal(_unsealed([m[2] for m in msgs], md_bytes, world))
    return sealed.manifest_bytes, sealed.marker_bytes, sealed.parts


def _coordinator(wire: _Wire, world: int, clock: _Clock, validate: bool
                 ) -> dict[str, Any]:
    """DCP's default save path at the coordinator, then tierckpt's manifest; fills the
    wire's results and files the first time. Returns the files' bytes and a scatter size."""
    plans = clock("dcp.unpickle_plans", _loads, wire.plans)
    deduped = clock("dcp.dedup", dedup_save_plans, plans, False)
    global_plan, md = clock("dcp.global_plan", create_default_global_save_plan, deduped)
    md = clock("dcp.merge_planner_data", _merge_planner_data, md, global_plan)
    if validate:
        errors = clock("dcp.validate", _validate_global_plan, global_plan, md)
        assert not errors, errors[:3]
    global_plan = [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
                   for i, p in enumerate(global_plan)]
    scattered = clock("dcp.pickle_scatter", lambda ps: [pickle.dumps(p) for p in ps],
                      global_plan)
    if wire.results is None:  # the ranks write (not the coordinator's cost)
        done = [written(r, p, wire.stretch) for r, p in enumerate(global_plan)]
        wire.results = [pickle.dumps(r) for r, _ in done]
        wire.files = [pickle.dumps([f]) for _, f in done]
        del done
    del plans, deduped, global_plan
    results = clock("dcp.unpickle_results", _loads, wire.results)
    md_bytes = clock("dcp.finish_metadata", _finish, md, results)
    del results, md
    assert wire.files is not None
    files = clock("tierckpt.unpickle_files", _loads, wire.files)
    m_bytes, marker = clock("tierckpt.manifest", _manifest, files, md_bytes, world)
    return {"metadata": md_bytes, "manifest": m_bytes, "marker": marker,
            "scatter_rank1": len(scattered[min(1, world - 1)])}


def _restore_rank(sizes: dict[str, Any], clock: _Clock) -> None:
    """What every rank does with the two files on restore today (``restore/loader.py``)."""
    clock("restore.parse_manifest", mf.Manifest.from_bytes, sizes["manifest"])
    clock("restore.unpickle_metadata", lambda b: load_metadata(b, source=".metadata"),
          sizes["metadata"])


def _validate_per_shape(world: int) -> dict[str, Any]:
    """Seconds ``_validate_global_plan`` spends on one key of each distinct shape at
    ``world``, and the estimate for the 80-layer state (× keys of that shape)."""
    plans = [local_plan(r, world, 1) for r in range(world)]
    global_plan, md = create_default_global_save_plan(dedup_save_plans(plans, False))
    per_shape: dict[str, dict[str, Any]] = {}
    for name, shape in LAYER:
        label = "x".join(map(str, shape))
        keys = LAYERS * (1 + len(MOMENTS))
        if label in per_shape:
            per_shape[label]["keys"] += keys
            continue
        one = Metadata({k: v for k, v in md.state_dict_metadata.items()
                        if k == f"model.layers.0.{name}"})
        per_shape[label] = {"seconds_per_key": _best(_validate_global_plan, global_plan, one),
                            "ours_seconds_per_key": _best(validate_global_plan, global_plan,
                                                          one),
                            "keys": keys}
    total = sum(v["seconds_per_key"] * v["keys"] for v in per_shape.values())
    ours = sum(v["ours_seconds_per_key"] * v["keys"] for v in per_shape.values())
    return {"per_shape": per_shape, "estimate_seconds": total, "ours_estimate_seconds": ours}


def _best(fn: Callable[..., Any], *args: Any) -> float:
    """Best of up to 3 runs of ``fn(*args)`` (noise only slows), stopping after 1 s."""
    runs: list[float] = []
    while len(runs) < 3 and sum(runs) < 1.0:
        t = time.perf_counter()
        fn(*args)
        runs.append(time.perf_counter() - t)
    return min(runs)


def _merge_full(world: int, merge: Callable[[list[dict]], dict] | None = None) -> float:
    """Seconds of the ``planner_data`` merge (``dict(ChainMap(*maps))``) for the full
    80-layer state at ``world``. Not scaled from fewer layers: its main cost is W² failed
    lookups (each rank's ``rank_state.<r>`` key is found only after every earlier rank's
    map was tried), whose unit cost grows with the maps' size (cache misses). The maps
    share their key and path objects here, unlike a real coordinator's unpickled ones;
    lookups go by the keys' cached hashes, so that changes little."""
    shared = dict(local_plan(0, 1, LAYERS).planner_data)
    del shared["rank_state.0"]
    maps = [{**shared, f"rank_state.{r}": ("rank_state", str(r))} for r in range(world)]
    t = time.perf_counter()
    merged = merge(maps) if merge is not None else dict(ChainMap(*maps))
    seconds = time.perf_counter() - t
    assert len(merged) == len(shared) + world
    return seconds


def _scaled(v0: float, vl: float, layers: int) -> float:
    return v0 + (vl - v0) * LAYERS / layers


def _measure(world: int, layers: int, validate: bool) -> dict[str, Any]:
    """One pass timed and one traced at ``layers``; seconds, peak and sizes."""
    full = LAYERS / layers if layers else 1
    wire = _Wire([pickle.dumps(local_plan(r, world, layers)) for r in range(world)], full)
    clock = _Clock()
    sizes = _coordinator(wire, world, clock, validate)
    _restore_rank(sizes, clock)
    plan0 = local_plan(0, world, layers)
    results0, _ = written(0, plan0, full)
    own = clock("rank.build_metadata", lambda: pickle.dumps(rank_metadata(plan0, results0)))
    clock("rank.parse_metadata", lambda b: load_metadata(b, source="__0.metadata"), own)
    assert wire.files is not None
    shards = [pickle.loads(b)[0] for b in wire.files]
    rec = clock("rank.build_records", records.to_bytes, 0, shards[:1])
    # shard sizes as in the full state (stretched), so this needs no scaling
    now = [_rank_files(r, f, own, rec) for r, f in enumerate(shards)]
    # a save with the plan cached and no rank's records changed: each rank sends a digest
    # and its three file entries; the coordinator builds the manifest and writes the
    # previous .metadata bytes again (nothing to build)
    # and the SHA-256 of the .metadata it holds (domain owners; others send None)
    gather_now = [pickle.dumps((bytes(32), None, files, None, bytes(32))) for files in now]
    manifest_now, marker_now, parts = clock("now.coordinator", _coordinator_now, gather_now,
                                     sizes["metadata"], world)
    # what each domain owner receives: the manifest, the marker, and the digest of the
    # .metadata it already holds (not the bytes)
    owner_now = len(pickle.dumps((manifest_now, marker_now, None, bytes(32))))
    clock("now.parse_manifest", mf.Manifest.from_bytes, manifest_now)
    # a rank that is not its domain's owner, since the parts: the marker and its part
    part0 = parts[layout.part_filename(0)]
    clock("now.parse_part", lambda: verify_part(marker_now, layout.part_filename(0), part0,
                                                   rank=0))
    del shards, now
    gc.collect()
    tracemalloc.start()
    try:
        _coordinator_now(gather_now, sizes["metadata"], world)
        now_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        _coordinator(wire, world, _Clock(), validate=False)  # allocates little; see above
        coordinator_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        _restore_rank(sizes, _Clock())
        restore_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert wire.files is not None
    sent = len(pickle.dumps((sizes["manifest"], sizes["marker"], sizes["metadata"])))
    return {
        "seconds": clock.s,
        "coordinator_peak_bytes": coordinator_peak, "restore_peak_bytes": restore_peak,
        "metadata_bytes": len(sizes["metadata"]), "manifest_bytes": len(sizes["manifest"]),
        "gathered_plan_bytes": sum(map(len, wire.plans)),
        "gathered_result_bytes": sum(map(len, wire.results or ())),
        "file_list_bytes": sum(map(len, wire.files)),
        "scatter_rank1_bytes": sizes["scatter_rank1"], "broadcast_payload_bytes": sent,
        "rank_metadata_bytes": len(own), "records_bytes": len(rec),
        "manifest_now_size": len(manifest_now), "now_peak_size": now_peak,
        "marker_now_size": len(marker_now), "part_size": len(part0),
        "header_size": len(json.dumps(json.loads(part0)["header"], separators=(",", ":"))),
        "now_gathered_size": sum(map(len, gather_now)), "now_owner_size": owner_now,
    }


def _measure_base(world: int, passes: int = 3) -> dict[str, Any]:
    """``_measure`` at 0 layers, each phase's seconds the least of ``passes`` (it is cheap):
    a scaled time is ``v(0) + (v(L) − v(0)) × 80 / L``, so a v(0) slowed by a busy
    machine would be subtracted 80 / L times over (negative phases at L = 1)."""
    runs = [_measure(world, 0, validate=False) for _ in range(passes)]
    best = runs[0]
    best["seconds"] = {k: min(r["seconds"][k] for r in runs) for k in best["seconds"]}
    return best


def synthetic_point(world: int, item_cap: int = ITEM_CAP,
                    validate_full_s: float = VALIDATE_FULL_S) -> dict[str, Any]:
    """Everything the module docstring lists at ``world`` ranks, for the 80-layer state.

    Runs with Python's cyclic GC off: its collections while millions of objects are
    unpickled cost several times the work itself, by an amount that depends on everything
    else the process holds, which would make the points incomparable."""
    was = gc.isenabled()
    gc.disable()
    try:
        return _point(world, item_cap, validate_full_s)
    finally:
        if was:
            gc.enable()
        gc.collect()


def _point(world: int, item_cap: int, validate_full_s: float) -> dict[str, Any]:
    layers = max(1, min(LAYERS, item_cap // world))
    started = time.perf_counter()
    val = _validate_per_shape(world)
    full = layers == LAYERS and val["estimate_seconds"] <= validate_full_s
    at_l, at_0 = _measure(world, layers, validate=full), _measure_base(world)

    def scale(key: str) -> float:
        return _scaled(at_0[key], at_l[key], layers)
    # now.*: O(W), nothing in it grows with layers (file sizes are the full state's)
    seconds = {k: v if k.startswith("now.") else _scaled(at_0["seconds"].get(k, 0.0), v, layers)
               for k, v in at_l["seconds"].items()}
    seconds["dcp.validate"] = seconds["dcp.validate"] if full else val["estimate_seconds"]
    if layers != LAYERS:
        seconds["dcp.merge_planner_data"] = _merge_full(world)
    seconds["now.validate"] = val["ours_estimate_seconds"]
    seconds["now.merge_planner_data"] = _merge_full(world, merge_first_wins)
    dcp = sum(v for k, v in seconds.items() if k.startswith("dcp."))
    # a save that plans (the first, or a new layout) since _torch/planner.py
    replan = dcp - seconds["dcp.validate"] - seconds["dcp.merge_planner_data"] \
        + seconds["now.validate"] + seconds["now.merge_planner_data"]
    ours = sum(v for k, v in seconds.items() if k.startswith("tierckpt."))
    sized = {k: round(scale(k)) for k in at_l if k.endswith("_bytes")}
    per_rank_read = sized["metadata_bytes"] + sized["manifest_bytes"]
    return {
        "world": world, "layers_built": layers, "scaled": layers != LAYERS,
        "validate": {"measured": full, **val},
        "seconds": seconds, "dcp_coordinator_seconds": dcp,
        "tierckpt_commit_seconds": ours,
        "restore_rank_seconds": seconds["restore.parse_manifest"]
        + seconds["restore.unpickle_metadata"],
        # a restore on the saved layout since the rank files: the manifest and its own
        # __<rank>.metadata (rank 0's, built as save/coordinate.rank_metadata builds it)
        "now_coordinator_seconds": seconds["now.coordinator"],
        "replan_coordinator_seconds": replan,
        "now_coordinator_peak_bytes": at_l["now_peak_size"],
        "now_received_bytes": at_l["now_gathered_size"],
        # each domain owner, per save: before, the manifest, marker and whole .metadata;
        # since, the manifest, marker and the .metadata's digest (it holds the bytes)
        "owner_received_bytes": sized["broadcast_payload_bytes"],
        "now_owner_received_bytes": at_l["now_owner_size"],
        "rank_restore_seconds": seconds["now.parse_manifest"]
        + seconds["rank.parse_metadata"],
        **sized, "restore_read_bytes_per_rank": per_rank_read,
        # its entries do not grow with layers (sizes already full): not scaled
        "manifest_now_bytes": at_l["manifest_now_size"],
        "rank_restore_read_bytes_per_rank": sized["rank_metadata_bytes"]
        + at_l["manifest_now_size"],
        # since the manifest parts, on the saved layout: a rank that is not its domain's
        # owner reads the marker (every part's digest), its part and its own metadata;
        # an owner (it verifies its domain from the parts) besides the marker again, the
        # first part (the header: domains) and its own part again. Part 0 (rank 0's, the
        # header in it) is the largest part: the worst rank of each kind
        "marker_bytes": at_l["marker_now_size"], "part_bytes": at_l["part_size"],
        "header_bytes": at_l["header_size"],
        "part_restore_read_bytes_per_rank": sized["rank_metadata_bytes"]
        + at_l["marker_now_size"] + at_l["part_size"],
        "owner_restore_read_bytes_per_rank": sized["rank_metadata_bytes"]
        + 2 * at_l["marker_now_size"] + 2 * at_l["part_size"],
        # up to 7d06d96 an owner verified the checkpoint through the whole manifest
        "manifest_owner_restore_read_bytes_per_rank": sized["rank_metadata_bytes"]
        + at_l["marker_now_size"] + at_l["part_size"] + at_l["manifest_now_size"],
        "part_restore_seconds": seconds["now.parse_part"] + seconds["rank.parse_metadata"],
        # a non-coordinator rank up to fd5185e: its scattered plan, every rank's file
        # list (all-gather), the manifest, marker and .metadata (broadcast)
        "save_received_bytes_per_rank": sized["scatter_rank1_bytes"]
        + sized["file_list_bytes"] + sized["broadcast_payload_bytes"],
        "manifest_over_read_limit": sized["manifest_bytes"] > 64 << 20,
        "manifest_over_manifest_limit": at_l["manifest_now_size"] > MANIFEST_LIMIT,
        "wall_seconds": time.perf_counter() - started,
        "raw": {"at_layers": at_l, "at_0": at_0},
    }


def measure_synthetic(worlds: tuple[int, ...], item_cap: int = ITEM_CAP,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """:func:`synthetic_point` for each of ``worlds``, in order."""
    points = []
    for w in worlds:
        p = synthetic_point(w, item_cap)
        log(f"synthetic W={w}: {p['layers_built']} layers built, DCP coordinator "
            f"{p['dcp_coordinator_seconds']:.2f} s (validate {p['seconds']['dcp.validate']:.2f}"
            f" s), .metadata {p['metadata_bytes'] / 2**20:.1f} MiB, manifest "
            f"{p['manifest_bytes'] / 2**20:.1f} MiB, {p['wall_seconds']:.0f} s")
        points.append(p)
        gc.collect()
    return {"layers": LAYERS, "tensors": LAYERS * len(LAYER), "item_cap": item_cap,
            "points": points}
