"""The sharing readers against their limits, in the same run: ``tierckpt.share.load`` of the
model alone from tier 2, and ``tierckpt.share.export`` of it to local safetensors.

One checkpoint of a model and its AdamW state (``exp_avg`` + ``exp_avg_sq`` make the
optimizer 2× the model, so the model is ≈ 1/3 of the checkpoint) is saved by a one-process
``CheckpointManager`` and copied to tier 2 by the uploader that ``tierckpt upload`` runs.
Then, best of ``repeats`` each, the order alternating per repeat:

- ``load``: ``load(url, fresh_model)``; bytes read ÷ checkpoint bytes, and the same model
  records fetched by plain boto3 (``boto3_ranges``: ranged ``get_object`` of exactly those
  byte ranges, split into the same 16 MiB parts over the same 8 threads, into memory,
  nothing verified — what ``load`` does minus verifying, unpickling and copying). For scale,
  ``boto3_coalesced``: the same bytes with adjacent records merged into one range (what a
  reader that coalesced its ranges would request), and ``boto3_whole``: boto3's transfer
  manager fetching every shard object whole into memory (a reader without ranged reads).
- ``export``: ``export(tier1_root, out)`` (the tier-1 files are still in the page cache
  from the save; ``source_resident`` says how much) in a fresh child process; tensor bytes ÷
  seconds against the buffered sequential write + fsync of the same byte count
  (``limits.write_limits``). The child's peak RSS growth over its baseline after imports
  (``/proc/self/clear_refs`` resets VmHWM there) ÷ the largest shard file and ÷ the largest
  tensor; ``max_shard_bytes`` is a quarter of the model, so there are several shards.

Tier 2 is ``$TIERCKPT_BENCH_S3_URL`` (a fresh prefix under it, removed afterwards;
credentials and endpoint from the environment) or a SeaweedFS started on loopback
(``tests/s3server.py``). Rates are decimal MB/s; ratios are tierckpt ÷ reference.

``python -m bench.share [--mib 1024] [--repeats 2]`` prints the table and the JSON.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench._cli import run_section
from bench.limits import write_limits
from bench.measure import best_of
from bench.pagecache import files_under, resident_fraction
from bench.state import StateModule, build_state, empty_like_state, make_specs, state_bytes
from bench.transfer import content_keys, remove_remote, tier2
from tierckpt import CheckpointManager, TrainState
from tierckpt.share.export import export
from tierckpt.share.loader import load
from tierckpt.share.source import open_checkpoint
from tierckpt.tier2.storage.url import parse_url
from tierckpt.tier2.uploader import Uploader, UploaderConfig

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
STEP = 1
_CHILD = ("import json, sys; from bench.share import export_child; "
          "print(json.dumps(export_child(sys.argv[1], sys.argv[2], int(sys.argv[3]))))")


@dataclass(frozen=True)
class Saved:
    """The committed checkpoint as tier 2 holds it: what the boto3 references fetch."""

    url: str
    total_bytes: int
    objects: dict[str, int]
    """Full object key → size, of the shard data files (``.distcp``)."""
    records: list[tuple[str, int, int]]
    """``(full object key, offset, length)`` of every model record, in file order."""

    @property
    def spans(self) -> list[tuple[str, int, int]]:
        """The records with adjacent ones merged: the fewest ranges holding the model."""
        out: list[tuple[str, int, int]] = []
        for key, off, n in self.records:
            if out and out[-1][0] == key and out[-1][1] + out[-1][2] == off:
                out[-1] = (key, out[-1][1], out[-1][2] + n)
            else:
                out.append((key, off, n))
        return out


def _timed(runs: list[float], nbytes: int, **extra: Any) -> dict[str, Any]:
    out = best_of(runs, nbytes, **extra).to_json()
    out["MB_s"] = out["gbps"] * 1e3
    return out


def _model_and_optimizer(model_bytes: int) -> tuple[StateModule, torch.optim.Optimizer]:
    """bench.state's tensor mix as a module, and AdamW after one step (state allocated)."""
    model = StateModule(build_state(make_specs(model_bytes)))
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)  # no temp copies
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _save_and_upload(root: Path, url: str, model: StateModule,
                     opt: torch.optim.Optimizer) -> dict[str, Any]:
    t0 = time.perf_counter()
    with CheckpointManager(tier1=root) as ck:
        ck.save(STEP, TrainState(model=model, optimizer=opt)).wait()
    saved = time.perf_counter() - t0
    with Uploader(UploaderConfig(tier1=root, tier2=url)) as up:
        results = up.drain()
    if [r.status for r in results] != ["verified"]:
        raise RuntimeError(f"upload of step {STEP} to {url} did not verify: {results}")
    up_s, up_bytes = results[0].seconds, results[0].bytes
    return {"save_seconds": saved, "upload_seconds": up_s, "upload_bytes": up_bytes,
            "upload_MB_s": up_bytes / up_s / 1e6 if up_s > 0 else 0.0}


def _saved(url: str) -> Saved:
    with open_checkpoint(url, step=STEP) as ckpt:
        md = ckpt.metadata()
        if md.storage_data is None:
            raise RuntimeError(f"{url}: .metadata has no storage data")
        ranges = {(i.relative_path, i.offset, i.length) for idx, i in md.storage_data.items()
                  if idx.fqn.partition(".")[0] == "model"}
        total = ckpt.manifest.total_bytes
        sizes = {f.name: f.size for f in ckpt.manifest.files if f.name.endswith(".distcp")}

    key = content_keys(url, STEP)  # each shard's object, through the step's map

    return Saved(url, total, {key(n): s for n, s in sizes.items()},
                 [(key(n), o, ln) for n, o, ln in sorted(ranges)])


def _boto3_ranges(client: Any, bucket: str, ranges: list[tuple[str, int, int]], part: int,
                  threads: int) -> float:
    """Seconds to GET exactly ``ranges`` into memory, ``part`` bytes a request."""
    bufs = [memoryview(bytearray(length)) for _, _, length in ranges]
    pieces = [(key, off + o, min(part, length - o), buf[o:])
              for (key, off, length), buf in zip(ranges, bufs, strict=True)
              for o in range(0, length, part)]

    def get(piece: tuple[str, int, int, memoryview]) -> None:
        key, start, n, view = piece
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")
        view[:n] = body["Body"].read()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, pieces))
    return time.perf_counter() - t0


def _boto3_whole(client: Any, tcfg: Any, bucket: str, saved: Saved) -> float:
    """Seconds for boto3's transfer manager to fetch every shard object into memory."""
    t0 = time.perf_counter()
    for key in saved.objects:
        client.download_fileobj(bucket, key, io.BytesIO(), Config=tcfg)
    return time.perf_counter() - t0


def _load_once(url: str, model: StateModule, results: list[Any]) -> float:
    """Seconds of one ``load(url, fresh_model)``; its LoadResult goes into ``results``."""
    fresh = StateModule(empty_like_state({n: p.detach() for n, p in model.named_parameters()}))
    t0 = time.perf_counter()
    results.append(load(url, fresh, step=STEP))
    seconds = time.perf_counter() - t0
    for (name, want), got in zip(model.named_parameters(), fresh.parameters(), strict=True):
        if not torch.equal(want.detach(), got):
            raise AssertionError(f"load({url}) put wrong values into {name}")
    return seconds


def _load_vs_boto3(saved: Saved, model: StateModule, repeats: int) -> dict[str, Any]:
    from bench import tier2_servers as t2  # lazy: importing it puts tests/ on sys.path

    # None (real AWS): botocore resolves the endpoint itself; _boto3 only passes it on
    client, tcfg = t2._boto3(os.environ.get("AWS_ENDPOINT_URL"))  # type: ignore[arg-type]
    bucket = parse_url(saved.url).location
    runs: dict[str, list[float]] = {"load": [], "ranges": [], "spans": [], "whole": []}
    results: list[Any] = []
    spans = saved.spans
    ops = [("load", lambda: _load_once(saved.url, model, results)),
           ("ranges", lambda: _boto3_ranges(client, bucket, saved.records, t2.PART,
                                            t2.CONCURRENCY)),
           ("spans", lambda: _boto3_ranges(client, bucket, spans, t2.PART, t2.CONCURRENCY)),
           ("whole", lambda: _boto3_whole(client, tcfg, bucket, saved))]
    for r in range(repeats):
        for name, fn in ops if r % 2 == 0 else ops[::-1]:
            runs[name].append(fn())
    last = results[-1]
    loaded = _timed(runs["load"], last.bytes_read, read_ratio=last.bytes_read / saved.total_bytes,
                  checkpoint_bytes=last.checkpoint_bytes, tensors=last.tensors,
                  verified=last.verified, notes=list(last.notes))
    ranges = _timed(runs["ranges"], sum(n for _, _, n in saved.records),
                    records=len(saved.records), part_bytes=t2.PART, threads=t2.CONCURRENCY)
    coalesced = _timed(runs["spans"], ranges["bytes"], spans=len(spans))
    whole = _timed(runs["whole"], sum(saved.objects.values()), objects=len(saved.objects))
    return {"load": loaded, "boto3_ranges": ranges, "boto3_coalesced": coalesced,
            "boto3_whole": whole,
            "load_seconds_vs_boto3": loaded["seconds"] / ranges["seconds"],
            "load_ratio_vs_boto3": loaded["MB_s"] / ranges["MB_s"],
            "load_seconds_vs_coalesced": loaded["seconds"] / coalesced["seconds"],
            "load_seconds_vs_whole": loaded["seconds"] / whole["seconds"]}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def export_child(root: str, out: str, max_shard_bytes: int) -> dict[str, Any]:
    """Run in a fresh process (``_CHILD``): export, and the peak RSS growth it caused
    over the RSS after imports. JSON-able."""
    try:  # "5" resets VmHWM to the current RSS (Linux ≥ 4.0)
        Path("/proc/self/clear_refs").write_text("5")
        method = "clear_refs"
    except OSError:  # then VmHWM still holds the import peak: growth is a lower bound
        method = "vmhwm_unreset"
    base = _status_kib("VmRSS") * 1024
    s = export(root, Path(out), max_shard_bytes=max_shard_bytes)
    peak = _status_kib("VmHWM") * 1024
    return {"seconds": s.seconds, "bytes_read": s.bytes_read,
            "tensor_bytes": s.result.tensor_bytes, "tensors": s.result.tensors,
            "peak_tensor_bytes": s.result.peak_tensor_bytes,
            "files": [{"name": f.name, "size": f.size} for f in s.result.files],
            "baseline_rss_bytes": base, "peak_growth_bytes": max(0, peak - base),
            "rss_method": method}


def _export_in_child(root: Path, out: Path, max_shard_bytes: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(out),
                           str(max_shard_bytes)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"export child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _export_vs_write(work: Path, root: Path, model: StateModule,
                     repeats: int) -> dict[str, Any]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    limits = write_limits(work, params, repeats)
    (work / "limit-buffered.bin").unlink(missing_ok=True)
    limit = limits["write_buffered_fsync"].to_json()
    limit["MB_s"] = limit["gbps"] * 1e3
    max_shard = state_bytes(params) // 4
    resident = resident_fraction(files_under(root))
    children, out = [], work / "export"
    for r in range(repeats):
        out = work / f"export-{r}"
        children.append(_export_in_child(root, out, max_shard))
        if r < repeats - 1:
            shutil.rmtree(out)
    last = children[-1]
    shards = [f for f in last["files"] if f["name"].endswith(".safetensors")]
    largest_shard = max(f["size"] for f in shards)
    largest_tensor = max(t.nbytes for t in params.values())
    peak = max(c["peak_growth_bytes"] for c in children)
    exported = _timed([c["seconds"] for c in children], last["tensor_bytes"],
                    out_dir=str(out), files=last["files"], shards=len(shards),
                    max_shard_bytes=max_shard, bytes_read=last["bytes_read"],
                    tensors=last["tensors"], source_resident=resident)
    return {"export": exported, "write_limit": limit,
            "export_ratio_vs_write_limit": exported["MB_s"] / limit["MB_s"],
            "export_ram": {"peak_growth_bytes": peak,
                           "runs": [c["peak_growth_bytes"] for c in children],
                           "baseline_rss_bytes": last["baseline_rss_bytes"],
                           "method": last["rss_method"],
                           "library_peak_tensor_bytes": last["peak_tensor_bytes"],
                           "largest_shard_bytes": largest_shard,
                           "largest_tensor_bytes": largest_tensor,
                           "ratio_vs_largest_shard": peak / largest_shard,
                           "ratio_vs_largest_tensor": peak / largest_tensor}}


def measure_share(work: Path, total_bytes: int, *, url: str | None = None,
                  repeats: int = 2) -> dict[str, Any]:
    """The section: a checkpoint of about ``total_bytes`` under ``work`` (created; the
    export of the last repeat is left in it), tier 2 per :func:`bench.transfer.tier2`.
    JSON-able."""
    work = work.absolute()  # the export child and the server run in other directories
    work.mkdir(parents=True, exist_ok=True)
    root = work / "tier1"
    model, opt = _model_and_optimizer(total_bytes // 3)
    with tier2(work, url, "share") as (remote, server):
        try:
            out: dict[str, Any] = {"server": server, "url": remote,
                                   "model_bytes": state_bytes(dict(model.named_parameters()))}
            out["checkpoint"] = _save_and_upload(root, remote, model, opt)
            del opt  # only the model is needed from here on
            saved = _saved(remote)
            out["checkpoint"].update(bytes=saved.total_bytes, shard_objects=len(saved.objects))
            out.update(_load_vs_boto3(saved, model, repeats))
        finally:
            remove_remote(remote, "share")
    out.update(_export_vs_write(work, root, model, repeats))
    return out


def _mb(m: dict[str, Any]) -> str:
    return f"{m['seconds']:.3g} | {m['MB_s']:.0f}"


def markdown(s: dict[str, Any]) -> list[str]:
    """The section as Markdown lines (a table and one line of context)."""
    lines = ["## Sharing readers (same run)", ""]
    if "skipped" in s:
        return [*lines, f"**Skipped:** {s['skipped']}", ""]
    loaded, ram = s["load"], s["export_ram"]
    lines += [
        "| measurement | seconds | MB/s | figure | vs reference |", "|---|---|---|---|---|",
        f"| `load(url, model)` from tier 2, model only | {_mb(loaded)} | read "
        f"{loaded['read_ratio']:.3f} of the checkpoint | {s['load_seconds_vs_boto3']:.2f}× "
        f"boto3's seconds ({s['load_ratio_vs_boto3']:.2f}× its MB/s) |",
        f"| boto3 `get_object` of the same ranges, unverified | {_mb(s['boto3_ranges'])} | "
        f"{s['boto3_ranges']['records']} records | reference |",
        f"| boto3 `get_object`, adjacent records merged | {_mb(s['boto3_coalesced'])} | "
        f"{s['boto3_coalesced']['spans']} spans | load takes "
        f"{s['load_seconds_vs_coalesced']:.2f}× its seconds |",
        f"| boto3 transfer manager, whole checkpoint | {_mb(s['boto3_whole'])} | "
        f"{s['boto3_whole']['objects']} objects | load takes "
        f"{s['load_seconds_vs_whole']:.2f}× its seconds |",
        f"| `export(tier1)` → safetensors | {_mb(s['export'])} | {s['export']['shards']} "
        f"shards | {s['export_ratio_vs_write_limit']:.2f}× the write limit |",
        f"| sequential write + fsync (buffered), same bytes | {_mb(s['write_limit'])} | | "
        "reference |",
        f"| export peak RSS growth (child process) | | | "
        f"{ram['peak_growth_bytes'] / MiB:.1f} MiB | {ram['ratio_vs_largest_shard']:.2f}× "
        f"largest shard, {ram['ratio_vs_largest_tensor']:.2f}× largest tensor |", "",
        f"Checkpoint {s['checkpoint']['bytes'] / MiB:.0f} MiB (model "
        f"{s['model_bytes'] / MiB:.0f} MiB + AdamW), tier 2 on {s['server']}; uploaded at "
        f"{s['checkpoint']['upload_MB_s']:.0f} MB/s. Export source "
        f"{s['export']['source_resident']:.0%} in the page cache.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.share``: run the section alone; print its table and JSON."""
    return run_section(
        argv, name="share", doc=__doc__, mib_help="checkpoint size in MiB", markdown=markdown,
        min_mib=3,  # the model is a third of the checkpoint: at least 1 MiB
        measure=lambda a, work: measure_share(work, a.mib * MiB, repeats=a.repeats))


if __name__ == "__main__":
    sys.exit(main())
