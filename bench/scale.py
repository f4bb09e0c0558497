"""Scale, structurally: what one save and one restore ask of each rank as the world grows.

``python -m bench.run --scale`` (``make bench BENCH_ARGS=--scale``; or ``python -m
bench.scale``). Two parts, both counting rather than timing (the machine is shared):

1. **Real gloo runs** at W = 1, 2, 4, 8, 16 (``--world``; spawned ranks, ``bench._dist``,
   one thread each): a tiny FSDP2 model (:data:`LAYERS` ``Linear`` layers, each
   ``fully_shard``-ed, AdamW stepped once) in ``tierckpt.CheckpointManager(tier1=...)``
   with ``TrainState``. After one warm-up save, one save and then one restore by a fresh
   manager in the same processes are each run under
   ``tierckpt.runtime.commcount.counting`` (collectives by kind, pickled bytes sent and
   received per rank) and, for the restore, under an audit hook that records every file
   each rank opens for reading below the checkpoint root (:class:`Reads`: metadata files by
   name, with their sizes — they are read whole — and how many shard files). Plain DCP
   (``dcp.save``/``dcp.load`` of the same ``get_state_dict`` with
   ``FileSystemWriter``/``FileSystemReader``) is counted the same way in the same
   processes. The commit round trip of the counted save (the ``save_committed`` event's
   ``write_seconds`` minus the slowest rank's ``save_durable`` seconds) is the one timing,
   and noisy: all ranks share two cores.
2. **Synthetic planning** at W = 16, 256, 1,024, 4,096 (``--synthetic-world``) in this
   process: ``bench.scale_synth``.

Results: ``<stamp>-scale.json``, ``.md`` and ``.png`` (``bench.scale_report``). The
results record which ``tierckpt`` was measured (its path, the git commit and whether
``src/`` had changes), so a before and an after can be told apart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench import _dist, scale_report
from bench.machine import machine_facts
from bench.reads import Reads
from bench.scale_synth import ITEM_CAP, measure_synthetic
from tierckpt.errors import ConfigError

SCHEMA = "tierckpt-bench-scale/1"
DEFAULT_WORLDS = (1, 2, 4, 8, 16)
DEFAULT_SYNTHETIC = (16, 256, 1024, 4096)
LAYERS, WIDTH = 4, 32
"""The real runs' model: 4 ``Linear(32, 32)`` (every rank holds 2 rows of each at W=16)."""
WARM_STEP, STEP = 1, 2
TIMEOUT_S = 300.0
_RANK_RAM = 700 << 20  # a rank process with torch and tierckpt imported (bench/sweep.py)
_RESERVE = 2 << 30
_REPO = Path(__file__).resolve().parent.parent


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] scale: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- rank function


@dataclass(frozen=True)
class ScaleJob:
    """Where the ranks write (a directory on the filesystem under test)."""

    target_dir: str


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    return model, opt


def _ours(model: nn.Module, opt: torch.optim.Optimizer, root: Path) -> dict[str, Any]:
    import tierckpt
    from tierckpt.runtime.commcount import counting

    ts = tierckpt.TrainState(model=model, optimizer=opt)
    with tierckpt.CheckpointManager(tier1=root, keep_last=2) as ckpt:
        ckpt.save(WARM_STEP, ts).wait(TIMEOUT_S)
        dist.barrier()
        with counting() as save:
            ckpt.save(STEP, ts).wait(TIMEOUT_S)
    dist.barrier()
    with counting() as opened:
        ckpt = tierckpt.CheckpointManager(tier1=root, keep_last=2)
    with ckpt, Reads(root) as reads, counting() as restore:
        info = ckpt.restore(ts)
    assert info is not None and info.step == STEP, info
    return {"save": save.to_json(), "restore": {**restore.to_json(), "reads": reads.to_json()},
            "open": opened.to_json()}


def _plain(model: nn.Module, opt: torch.optim.Optimizer, root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tierckpt.runtime.commcount import counting

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(root / "warm"))
    dist.barrier()
    with counting() as save:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(root / "ckpt"))
    dist.barrier()
    with Reads(root / "ckpt") as reads, counting() as load:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(root / "ckpt"))
    return {"save": save.to_json(), "restore": {**load.to_json(), "reads": reads.to_json()}}


def scale_rank(rank: int, world: int, job: ScaleJob) -> dict[str, Any]:
    """One rank of a real run: tierckpt's save and restore counted, then plain DCP's; rank
    0 adds the commit round trip of the counted save (``commit_s``)."""
    from bench.sweep import _phases

    warnings.filterwarnings("ignore")
    root = Path(job.target_dir) / f"scale-w{world}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    model, opt = _model()
    out: dict[str, Any] = {"tierckpt": _ours(model, opt, root / "tier1"),
                           "dcp": _plain(model, opt, root / "dcp")}
    dist.barrier()
    if rank == 0:
        out["commit_s"] = _phases(root / "tier1", range(STEP, STEP + 1))["commit_s"][0]
        shutil.rmtree(root, ignore_errors=True)
    return out


# ------------------------------------------------------------------------ summaries


def _side(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One operation (a save or a restore) over the ranks: collectives (the most any rank
    made: they agree in a collective protocol), by kind, bytes the coordinator (rank 0)
    received and sent, the most any other rank received; for restores, metadata reads."""
    out: dict[str, Any] = {
        "collectives": max(r["collectives"] for r in ranks),
        "by_kind": ranks[0]["by_kind"],
        "coordinator_received": ranks[0]["received"], "coordinator_sent": ranks[0]["sent"],
        "other_received_max": max((r["received"] for r in ranks[1:]), default=None),
        "per_rank": [{k: r[k] for k in ("collectives", "sent", "received")} for r in ranks],
    }
    if "reads" in ranks[0]:
        reads = [r["reads"] for r in ranks]
        worst = max(range(len(reads)), key=lambda i: reads[i]["metadata_bytes"])
        out["metadata_read_max"] = reads[worst]["metadata_bytes"]
        out["metadata_read_min"] = min(r["metadata_bytes"] for r in reads)
        out["metadata_read_by_file"] = reads[worst]["by_file"]
        out["metadata_read_rank"] = worst
        out["shard_files_max"] = max(r["shard_files"] for r in reads)
        # every rank but rank 0, the owner of the one domain here (it verifies the
        # checkpoint: the whole manifest); None at W = 1
        other = max(range(1, len(reads)), key=lambda i: reads[i]["metadata_bytes"],
                    default=None)
        out["metadata_read_other_max"] = None if other is None else \
            reads[other]["metadata_bytes"]
        out["metadata_read_other_by_file"] = None if other is None else reads[other]["by_file"]
        out["metadata_read_owner"] = reads[0]["metadata_bytes"]
        out["metadata_read_owner_by_file"] = reads[0]["by_file"]
    return out


def summarize_real(world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-W record of a real run (see ``bench.scale_report`` for the layout)."""
    return {"world": world,
            "tierckpt": {op: _side([r["tierckpt"][op] for r in ranks])
                         for op in ("save", "restore", "open")},
            "dcp": {op: _side([r["dcp"][op] for r in ranks]) for op in ("save", "restore")},
            "commit_s": ranks[0]["commit_s"]}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure_real(work: Path, worlds: tuple[int, ...], errors: list[str]) -> list[dict[str, Any]]:
    """Each of ``worlds`` in fresh rank processes; a world that fails or would not fit in
    RAM is recorded as ``{"world", "skipped"}`` (failures also in ``errors``)."""
    points: list[dict[str, Any]] = []
    for w in worlds:
        need, avail = w * _RANK_RAM + _RESERVE, _mem_available()
        if need > avail:
            points.append({"world": w, "skipped": f"needs about {need / 2**30:.1f} GiB of "
                                                  f"RAM, {avail / 2**30:.1f} GiB available"})
            continue
        _log(f"real W={w} ...")
        start = time.perf_counter()
        try:
            ranks = _dist.run_ranks(w, scale_rank, ScaleJob(str(work)))
        except Exception as exc:  # record and go on: the other worlds still count
            traceback.print_exc()
            errors.append(f"real world {w}: {exc!r}")
            points.append({"world": w, "skipped": f"failed: {exc!r}"})
            continue
        p = summarize_real(w, ranks)
        p["wall_seconds"] = time.perf_counter() - start
        t = p["tierckpt"]
        _log(f"real W={w}: save {t['save']['collectives']} collectives, restore "
             f"{t['restore']['collectives']}, metadata read "
             f"{t['restore']['metadata_read_max']} B, commit {p['commit_s'] * 1e3:.1f} ms "
             f"({p['wall_seconds']:.0f} s)")
        points.append(p)
    return points


# ------------------------------------------------------------------------------ run


def parse_world_list(text: str, flag: str, most: int) -> tuple[int, ...]:
    """``"1,2,4"`` → (1, 2, 4); ConfigError naming ``flag`` unless each is in 1..``most``."""
    try:
        worlds = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: write comma-separated integers, e.g. 1,2,4"
                          ) from None
    if not worlds or any(w < 1 or w > most for w in worlds):
        raise ConfigError(f"{flag} {text!r}: each world size must be between 1 and {most}")
    return tuple(dict.fromkeys(worlds))


def code_under_test() -> dict[str, Any]:
    """Which tierckpt this run measured: its path, and the git commit and changed files
    under ``src/`` when that path is this repository's."""
    import tierckpt

    path = Path(tierckpt.__file__).resolve().parent
    out: dict[str, Any] = {"tierckpt": str(path)}
    if path.is_relative_to(_REPO / "src"):
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True,
                                  text=True, check=False).stdout.strip()
        out["commit"] = git("rev-parse", "--short", "HEAD")
        out["changed"] = git("status", "--porcelain", "--", "src").splitlines()
    return out


def run_scale(*, worlds: str | None, synthetic: str | None, out: Path, target: Path,
              item_cap: int = ITEM_CAP, label: str | None = None) -> int:
    """Measure both parts, write ``<stamp>-scale.{json,md,png}`` into ``out``; the exit
    status (0 every world ran or was skipped for room, 1 one failed, 2 bad arguments).
    ``label`` names the code measured in the results (e.g. "before: HEAD's src")."""
    try:
        real = parse_world_list(worlds, "--world", 64) if worlds else DEFAULT_WORLDS
        synth = parse_world_list(synthetic, "--synthetic-world", 1 << 16) if synthetic \
            else DEFAULT_SYNTHETIC
    except ConfigError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned ranks inherit it
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    work = target / f"scale-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    try:
        facts = machine_facts(work)
        real_points = measure_real(work, real, errors)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log("synthetic ...")
    synthetic_part = measure_synthetic(synth, item_cap, log=_log)
    results = {"schema": SCHEMA, "started": started,
               "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "wall_seconds": time.perf_counter() - t0, "machine": facts,
               "code": {**code_under_test(), "label": label},
               "real": {"layers": LAYERS, "width": WIDTH, "worlds": list(real),
                        "points": real_points},
               "synthetic": synthetic_part, "errors": errors}
    paths = scale_report.write_scale(results, out, started.replace(":", ""))
    print(scale_report.render_markdown(results))
    print("results: {}\ntable:   {}\nplot:    {}".format(*paths))
    for e in errors:
        print(f"bench: scale point failed: {e}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.scale``: parse, then :func:`run_scale`."""
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", help="real world sizes (default 1,2,4,8,16)")
    ap.add_argument("--synthetic-world", help="synthetic world sizes (default "
                                              "16,256,1024,4096)")
    ap.add_argument("--out", type=Path, default=_REPO / "bench" / "results")
    ap.add_argument("--target", type=Path, default=_REPO / "bench" / "out",
                    help="directory on the filesystem under test (removed afterwards)")
    ap.add_argument("--label", help="what the measured code is, for the results "
                                    "(e.g. 'before', 'after: plan cache')")
    a = ap.parse_args(argv)
    return run_scale(worlds=a.world, synthetic=a.synthetic_world, out=a.out, target=a.target,
                     label=a.label)


if __name__ == "__main__":
    sys.exit(main())
