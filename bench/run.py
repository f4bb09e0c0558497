"""``python -m bench.run``: measure limits, plain DCP and tierckpt on one state; write results.

Exit status 0 when every section ran (skipped sections are fine), 1 when a section failed
(its error is in the results), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.config import BenchConfig, make_config
from bench.dcp_peers import PeerJob, measure_dcp
from bench.incremental import measure_incremental
from bench.limits import measure_limits
from bench.machine import fsync_probe, machine_facts
from bench.model_state import measure_model_state
from bench.preempt import measure_preempt
from bench.report import SCHEMA, write_results
from bench.scale import run_scale
from bench.share import measure_share
from bench.state import build_state, make_specs
from bench.sweep import run_sweep
from bench.targets import evaluate
from bench.tier0 import measure_tier0
from bench.tierckpt_paths import measure_tierckpt
from bench.transfer import measure_transfer
from tierckpt.errors import ConfigError

_REPO = Path(__file__).resolve().parent.parent
MODEL_STATE_BYTES = 128 << 20
"""The model-state section's size (``bench/model_state.py``): its point is the tensor count
(1,152 for 24 layers with AdamW), not the bytes."""
TIER2_SERVERS_MIB, TIER2_SERVERS_ROUNDS = 256, 3
"""The tier-2 clients' section (``bench/tier2_servers.py``): one file of this size per store,
median of this many rounds; not the state's size (its point is each client's throughput)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--size", help="total state size, e.g. 1GiB (default 1GiB; 64MiB with "
                                  "--quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64 MiB, world 1, one repeat, 3 saves, process mode skipped")
    p.add_argument("--world", help="comma-separated world sizes (default 1,2; 1 with --quick)")
    p.add_argument("--out", type=Path, default=_REPO / "bench" / "results",
                   help="directory for <stamp>.json and <stamp>.md")
    p.add_argument("--target", type=Path, default=_REPO / "bench" / "out",
                   help="directory on the filesystem under test (checkpoints go here and are "
                        "removed afterwards)")
    p.add_argument("--share", action=argparse.BooleanOptionalAction, default=None,
                   help="the sharing readers' section (bench/share.py: tier-2 load, export); "
                        "on by default, off with --quick")
    p.add_argument("--tier0", action=argparse.BooleanOptionalAction, default=None,
                   help="the tier-0 section (bench/tier0.py: restore from RAM vs tier 1 vs "
                        "tier 2, C and W with tier 0 on/off, the plan); on by default, off "
                        "with --quick")
    p.add_argument("--preempt", action=argparse.BooleanOptionalAction, default=None,
                   help="the preemption section (bench/preempt.py: notice → stop → durable "
                        "on tiers 0, 1, 2 at each world size, and the watcher's per-step "
                        "cost); on by default, off with --quick")
    p.add_argument("--tier2-servers", action=argparse.BooleanOptionalAction, default=None,
                   help="the tier-2 clients' section (bench/tier2_servers.py: upload and "
                        "fetch on SeaweedFS, moto, fake-gcs-server and Azurite, tierckpt "
                        "against each store's SDK and obstore); on by default, off with "
                        "--quick")
    p.add_argument("--incremental", action=argparse.BooleanOptionalAction, default=None,
                   help="the incremental saves' section (bench/incremental.py: a LoRA and a "
                        "frozen-embedding state, bytes staged, written and uploaded and the "
                        "durable time per save with Writes(incremental=True), without it and "
                        "with plain DCP); on by default, off with --quick")
    p.add_argument("--sweep", action="store_true",
                   help="only the cost curves (bench/sweep.py): C, durable, restore and RAM "
                        "over --sizes × --world (default 64MiB,256MiB,1GiB,4GiB × 1,2,4), "
                        "and the planner at 1 to 16,384 GPUs")
    p.add_argument("--sizes", help="with --sweep: comma-separated total state sizes")
    p.add_argument("--scale", action="store_true",
                   help="only the scale counts (bench/scale.py): collectives, bytes and "
                        "metadata per rank for a save and a restore in real gloo runs at "
                        "--world (default 1,2,4,8,16), beside plain DCP, and the planning "
                        "of a Llama-70B-shaped state at --synthetic-world ranks")
    p.add_argument("--heal", action="store_true",
                   help="only restart cost R by healing vs a full torchrun restart "
                        "(bench/heal.py) at --world (default 2,4) × --sizes in MiB "
                        "(default 256,1024)")
    p.add_argument("--synthetic-world",
                   help="with --scale: synthetic world sizes (default 16,256,1024,4096)")
    p.add_argument("--label", help="with --scale: what the measured code is (e.g. 'before')")
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _section(name: str, fn: Callable[[], dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    _log(f"{name} ...")
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # record and go on: the other sections are still worth having
        errors.append(f"{name}: {exc!r}")
        traceback.print_exc()
        return {"skipped": f"failed: {exc!r}", "error": traceback.format_exc(limit=3)}
    _log(f"{name} done in {time.perf_counter() - start:.1f} s")
    return out


def run(cfg: BenchConfig, *, share: bool | None = None, tier0: bool | None = None,
        preempt: bool | None = None, tier2_servers: bool | None = None,
        incremental: bool | None = None) -> tuple[dict[str, Any], list[str]]:
    """Every measurement of one run; the results dict (see ``report``) and section errors.

    ``share``: run the sharing readers' section (None: unless ``cfg.quick``); ``tier0``:
    the tier-0 section, likewise; ``preempt``: the preemption section, likewise;
    ``tier2_servers``: the tier-2 clients' section, likewise; ``incremental``: the
    incremental saves' section, likewise.
    """
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    workdir = cfg.target_dir / f"bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    try:
        facts = machine_facts(workdir)
        facts["fsync"] = fsync_probe(workdir)
        _log(f"limits on {cfg.size_bytes / 2**20:.0f} MiB in {workdir} ({facts['target_fs']})")
        state = build_state(make_specs(cfg.size_bytes))
        measured, cache = measure_limits(workdir, state, cfg.repeats, cfg.worlds)
        del state
        gc.collect()
        limits = {k: m.to_json() for k, m in measured.items()}
        facts["cache_drop"] = cache
        job = PeerJob(size_bytes=cfg.size_bytes, target_dir=str(workdir), repeats=cfg.repeats,
                      saves=cfg.saves, loop_seconds=cfg.loop_seconds,
                      process_mode=not cfg.quick)
        worlds: dict[str, dict[str, Any]] = {}
        for w in cfg.worlds:
            worlds[str(w)] = {
                "dcp": _section(f"dcp world {w}", partial(measure_dcp, job, w), errors),
                "tierckpt": _section(f"tierckpt world {w}", partial(measure_tierckpt, job, w),
                                     errors),
            }
        # a real model's state (many small tensors; ~1 min): off with --quick, as share is
        model_state = _section("model state", partial(
            measure_model_state, workdir / "model", MODEL_STATE_BYTES, repeats=cfg.repeats),
            errors) if not cfg.quick else {"skipped": "off with --quick"}
        transfer = _section("transfer", partial(measure_transfer, cfg, workdir / "xfer"), errors)
        # The sharing readers (bench/share.py): on unless --quick; --share/--no-share decide.
        if (not cfg.quick) if share is None else share:
            shared = _section("share", partial(measure_share, workdir / "share",
                                               cfg.size_bytes, repeats=cfg.repeats), errors)
        else:
            shared = {"skipped": "off (--quick or --no-share); pass --share to include it"}
        # Tier 0 (bench/tier0.py): on unless --quick; --tier0/--no-tier0 decide.
        if (not cfg.quick) if tier0 is None else tier0:
            tier0_section = _section("tier0", partial(measure_tier0, workdir / "tier0",
                                                      cfg.size_bytes, repeats=cfg.repeats),
                                     errors)
        else:
            tier0_section = {"skipped": "off (--quick or --no-tier0); pass --tier0 to "
                                        "include it"}
        if (not cfg.quick) if preempt is None else preempt:
            preempt_section = _section("preempt", partial(
                measure_preempt, workdir / "preempt", cfg.size_bytes,
                worlds=tuple(cfg.worlds)), errors)
        else:
            preempt_section = {"skipped": "off (--quick or --no-preempt); pass --preempt to "
                                          "include it"}
        if (not cfg.quick) if incremental is None else incremental:
            incremental_section = _section("incremental", partial(
                measure_incremental, workdir / "incremental", cfg.size_bytes,
                repeats=cfg.repeats), errors)
        else:
            incremental_section = {"skipped": "off (--quick or --no-incremental); pass "
                                              "--incremental to include it"}
        # Every store's test server, ours vs the other clients (bench/tier2_servers.py):
        # its own size (one file per store), not the state's; on unless --quick.
        if (not cfg.quick) if tier2_servers is None else tier2_servers:
            from bench import tier2_servers as t2s  # lazy: it puts tests/ on sys.path

            servers = _section("tier2 servers", partial(
                t2s.measure, workdir / "tier2-servers", TIER2_SERVERS_MIB,
                TIER2_SERVERS_ROUNDS), errors)
        else:
            servers = {"skipped": "off (--quick or --no-tier2-servers); "
                                  "tests/test_bench_tier2_servers.py runs it at 2 MiB"}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    facts["loadavg_end"] = list(os.getloadavg())
    targets = evaluate(limits, {int(w): s for w, s in worlds.items()},
                       {"transfer": transfer, "tier2_servers": servers})
    results = {
        "schema": SCHEMA, "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_seconds": time.perf_counter() - t0,
        "config": {"size_bytes": cfg.size_bytes, "quick": cfg.quick, "worlds": list(cfg.worlds),
                   "repeats": cfg.repeats, "saves": cfg.saves,
                   "loop_seconds": cfg.loop_seconds, "target_dir": str(cfg.target_dir)},
        "machine": facts, "limits": limits, "worlds": worlds, "transfer": transfer,
        "share": shared, "tier0": tier0_section, "preempt": preempt_section,
        "model_state": model_state, "tier2_servers": servers,
        "incremental": incremental_section,
        "targets": [t.to_json() for t in targets], "errors": errors,
    }
    return results, errors


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, write results; print where they are and each verdict."""
    args = _parse(argv)
    if args.scale:
        return run_scale(worlds=args.world, synthetic=args.synthetic_world, out=args.out,
                         target=args.target, label=args.label)
    if args.heal:
        from bench import heal

        return heal.main(["--world", args.world or "2,4", "--mib", args.sizes or "256,1024",
                          "--results", str(args.out), "--workdir", str(args.target)])
    if args.synthetic_world or args.label:
        print("bench: --synthetic-world and --label are for --scale", file=sys.stderr)
        return 2
    if args.sweep:
        return run_sweep(sizes=args.sizes, world=args.world, out=args.out, target=args.target)
    if args.sizes:
        print("bench: --sizes is for --sweep; use --size for one state", file=sys.stderr)
        return 2
    try:
        world = args.world or ("1" if args.quick else None)
        cfg = make_config(size=args.size, quick=args.quick, world=world, out=args.out,
                          target=args.target)
    except ConfigError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    results, errors = run(cfg, share=args.share, tier0=args.tier0, preempt=args.preempt,
                          tier2_servers=args.tier2_servers, incremental=args.incremental)
    stamp = results["started"].replace(":", "")
    json_path, md_path = write_results(results, cfg.out_dir, stamp)
    for t in results["targets"]:
        ratio = "—" if t["ratio"] is None else f"{t['ratio']:.2f}×"
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"w{t['world']} {t['goal']:<18} {t['subject']:<40} {ratio:>8} {verdict}")
    print(f"results: {json_path}\ntable:   {md_path}")
    for e in errors:
        print(f"bench: section failed: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
