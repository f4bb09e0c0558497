"""Results as JSON (``<stamp>.json``, schema ``tierckpt-bench/1``) and a Markdown table.

JSON layout (all seconds, bytes, decimal GB/s)::

    schema, started, finished, wall_seconds
    config   {size_bytes, quick, worlds, repeats, saves, loop_seconds, target_dir}
    machine  {cores, cores_usable, cpu_model, mem_total_bytes, kernel, python, torch,
              target_fs, target_mount, target_device, device_write_cache,
              loadavg_start, loadavg_end, fsync {median_fsync_s, honoured, rule},
              cache_drop {method, honoured, evictions}}
    limits   {copy_2threads, write_buffered_fsync, write_odirect_fsync, cold_read}
             each a Measurement {seconds, bytes, gbps, runs, ...}
    worlds   {"1": {"dcp": {...}, "tierckpt": {...} | {"skipped": reason}}, "2": ...}
    transfer {...} | {"skipped": reason}   (bench/transfer.py)
    share    {...} | {"skipped": reason}   (bench/share.py; absent in older results)
    model_state {...} | {"skipped": reason} (bench/model_state.py; absent in older results)
    tier0    {...} | {"skipped": reason}   (bench/tier0.py; absent in older results)
    preempt  {...} | {"skipped": reason}   (bench/preempt.py; absent in older results)
    tier2_servers {...} | {"skipped": reason} (bench/tier2_servers.py; absent in older results)
    incremental {...} | {"skipped": reason} (bench/incremental.py; absent in older results)
    targets  [{goal, text, world, subject, ratio, op, threshold, met, vs_dcp, note}]

``render_markdown`` only reads that dict, so a results file can be re-rendered later.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.targets import limits_for

SCHEMA = "tierckpt-bench/1"

_LIMIT_LABELS = {
    "copy_2threads": "2-thread `copy_` into existing buffers",
    "write_buffered_fsync": "sequential write + fsync (buffered)",
    "write_odirect_fsync": "sequential write + fsync (O_DIRECT, aligned)",
    "cold_read": "sequential cold read",
}
# (section, entry, label, the limit it is compared with; for the copy limit lower is better)
_ROWS = (
    ("dcp", "async_default_blocking", "C: dcp.async_save default", "copy_2threads"),
    ("dcp", "async_stager_blocking", "C: dcp.async_save + reused DefaultStager",
     "copy_2threads"),
    ("tierckpt", "blocking", "C: tierckpt save(), staging='sync'", "copy_2threads"),
    ("tierckpt", "blocking_overlap", "C: tierckpt save(), staging='overlap' (+ wait in step)",
     "copy_2threads"),
    ("tierckpt", "copy_inline", "the copy limit's procedure in the saving ranks, beside each "
     "sync save", "copy_2threads"),
    ("dcp", "save_t1", "durable: dcp.save thread_count=1", "write_odirect_fsync"),
    ("dcp", "save_t4", "durable: dcp.save thread_count=4", "write_odirect_fsync"),
    ("dcp", "torch_save_rank0", "durable: torch.save gathered on rank 0", "write_odirect_fsync"),
    ("dcp", "async_default_durable", "durable: dcp.async_save default (call → done)",
     "write_odirect_fsync"),
    ("tierckpt", "durable", "durable: tierckpt save() → committed", "write_odirect_fsync"),
    ("dcp", "load_cold", "cold restore: dcp.load", "cold_read"),
    ("tierckpt", "restore_cold", "cold restore: tierckpt restore()", "cold_read"),
    ("tierckpt", "own_files_read", "cold read of that checkpoint's own shard files, raw",
     "cold_read"),
)
_DCP_FOR = {"blocking": "async_default_blocking", "blocking_overlap": "async_default_blocking",
            "durable": "save_t1",
            "restore_cold": "load_cold"}


def write_results(results: dict[str, Any], out_dir: Path, stamp: str) -> tuple[Path, Path]:
    """Write ``<stamp>.json`` and ``<stamp>.md`` into ``out_dir``; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stamp}.json", out_dir / f"{stamp}.md"
    json_path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    md_path.write_text(render_markdown(results))
    return json_path, md_path


def _f(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}g}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _met(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[met]


def _machine(r: dict[str, Any]) -> list[str]:
    m = r["machine"]
    fsync, drop = m.get("fsync", {}), m.get("cache_drop", {})
    return [
        "## Machine", "", "| fact | value |", "|---|---|",
        f"| cores | {m['cores']} ({m['cores_usable']} usable), {m['cpu_model']} |",
        f"| memory | {m['mem_total_bytes'] / 2**30:.1f} GiB |",
        f"| target filesystem | {m['target_fs']} on {m['target_device']} (mounted at "
        f"{m['target_mount']}), device write cache: {m.get('device_write_cache')} |",
        f"| fsync honoured | {'yes' if fsync.get('honoured') else 'NO'} (median 4 KiB fsync "
        f"{fsync.get('median_fsync_s', 0) * 1e6:.0f} µs; rule: {fsync.get('rule')}) |",
        f"| page cache dropped | {'yes' if drop.get('honoured') else 'NO'} "
        f"(method: {drop.get('method')}) |",
        f"| load average start → end | {m['loadavg_start'][0]:.2f} → "
        f"{m.get('loadavg_end', [0])[0]:.2f} |",
        f"| torch / python / kernel | {m['torch']} / {m['python']} / {m['kernel']} |", "",
    ]


def _limits(r: dict[str, Any]) -> list[str]:
    lines = ["## Limits (same run)", "", "| limit | seconds | GB/s | note |", "|---|---|---|---|"]
    labels = {**_LIMIT_LABELS, **{k: f"cold read, {k.rsplit('x', 1)[1]} concurrent readers "
                                     "(the world-size limit)"
                                  for k in r["limits"] if k.startswith("cold_read_x")}}
    for key, label in labels.items():
        m = r["limits"].get(key, {})
        note = m.get("note", "") or ("" if m.get("cold", True) else "not cold")
        lines.append(f"| {label} | {_f(m.get('seconds'))} | {_f(m.get('gbps'))} | {note} |")
    return [*lines, ""]


def _world(r: dict[str, Any], world: str, sections: dict[str, Any]) -> list[str]:
    lines = [f"## World size {world}", "",
             "| measurement | seconds | GB/s | vs limit | vs DCP default |",
             "|---|---|---|---|---|"]
    for section, entry, label, limit_key in _ROWS:
        m = sections.get(section, {}).get(entry)
        if m is None or "seconds" not in m:
            continue
        limit = limits_for(r["limits"], int(world)).get(limit_key, {})
        if limit_key == "copy_2threads":
            vs_limit = m["seconds"] / limit["seconds"] if limit.get("seconds") else None
        else:
            vs_limit = m["gbps"] / limit["gbps"] if limit.get("gbps") else None
        ref = sections.get("dcp", {}).get(_DCP_FOR.get(entry, "")) if section == "tierckpt" \
            else None
        vs_dcp = (m["seconds"] / ref["seconds"] if limit_key == "copy_2threads"
                  else m["gbps"] / ref["gbps"]) if ref and ref.get("seconds") else None
        lines.append(f"| {label} | {_f(m['seconds'])} | {_f(m['gbps'])} | {_x(vs_limit)} | "
                     f"{_x(vs_dcp)} |")
    inline = sections.get("tierckpt", {}).get("blocking", {}).get("vs_copy_inline")
    if inline is not None:
        lines.append(f"| C: tierckpt save(), staging='sync', ÷ the copy beside it (vs limit "
                     f"= that copy) | | | {_x(inline)} | |")
    lines += ["", "| loop / RAM | idle steps/s | during steps/s | ratio | peak extra RAM | "
              "× state | growth |", "|---|---|---|---|---|---|---|"]
    for section, entry, label in (("dcp", "throughput", "during dcp.async_save"),
                                  ("tierckpt", "throughput", "during tierckpt save()"),
                                  ("tierckpt", "throughput_overlap",
                                   "during tierckpt save(), staging='overlap'")):
        t = sections.get(section, {}).get(entry)
        if t:
            lines.append(f"| {label} | {_f(t['idle_steps_s'])} | {_f(t['during_steps_s'])} | "
                         f"{_x(t['ratio'])} | | | |")
    for section, entry, label in (("dcp", "ram_thread", "dcp.async_save thread mode"),
                                  ("dcp", "ram_process", "dcp.async_save process mode"),
                                  ("tierckpt", "ram", "tierckpt save()")):
        m = sections.get(section, {}).get(entry)
        if m and "ratio" in m:
            lines.append(f"| {label} | | | | {m['peak_extra_bytes'] / 2**20:.0f} MiB | "
                         f"{_x(m['ratio'])} | {m['growth_ratio']:+.1%} |")
        elif m:
            lines.append(f"| {label} | skipped: {m.get('skipped')} | | | | | |")
    for section, content in sections.items():
        if "skipped" in content:
            lines += ["", f"**{section} skipped:** {content['skipped']}"]
    return [*lines, ""]


def _targets(r: dict[str, Any]) -> list[str]:
    lines = ["## Targets", "", "| goal | world | subject | ratio | target | verdict | vs DCP | "
             "note |", "|---|---|---|---|---|---|---|---|"]
    for t in r["targets"]:
        world = t["world"] or "—"
        lines.append(f"| {t['text']} | {world} | {t['subject']} | {_x(t['ratio'])} | "
                     f"{t['op']} {t['threshold']}× | {_met(t['met'])} | {_x(t['vs_dcp'])} | "
                     f"{t['note']} |")
    return [*lines, ""]


def render_markdown(r: dict[str, Any]) -> str:
    """The Markdown report of a results dict (see the module docstring for its layout)."""
    c = r["config"]
    head = [f"# tierckpt bench — {r['started']}", "",
            f"State {c['size_bytes'] / 2**20:.0f} MiB of fp32 tensors; world sizes "
            f"{', '.join(map(str, c['worlds']))}; best of {c['repeats']} repeats; "
            f"{c['saves']} saves for RAM; {'quick' if c['quick'] else 'full'} run in "
            f"{r['wall_seconds']:.0f} s. Rates are decimal GB/s; 'vs limit' is seconds ÷ limit "
            "for C and GB/s ÷ limit otherwise.", ""]
    body = head + _machine(r) + _limits(r)
    for world, sections in r["worlds"].items():
        body += _world(r, world, sections)
    if "transfer" in r:  # the tier-2 transfer section renders its own rows, as share does
        from bench.transfer import markdown as transfer_markdown

        body += transfer_markdown(r["transfer"])
    if "share" in r:  # its rows live with the section; imported here so report stays light
        from bench.share import markdown as share_markdown

        body += share_markdown(r["share"])
    if "tier0" in r:  # likewise: the tier-0 section renders its own rows
        from bench.tier0 import markdown as tier0_markdown

        body += tier0_markdown(r["tier0"])
    if "incremental" in r:  # likewise: frozen weights staged, written and uploaded once
        from bench.incremental import markdown as incremental_markdown

        body += incremental_markdown(r["incremental"])
    if "preempt" in r:  # likewise: notice → stop → durable, and the watcher's cost
        from bench.preempt import markdown as preempt_markdown

        body += preempt_markdown(r["preempt"])
    if "model_state" in r:  # likewise: a real model's many small tensors
        from bench.model_state import markdown as model_state_markdown

        body += model_state_markdown(r["model_state"])
    if "tier2_servers" in r:  # likewise: every store's server, ours vs the other clients
        from bench.tier2_servers import markdown as tier2_servers_markdown

        body += tier2_servers_markdown(r["tier2_servers"])
    return "\n".join(body + _targets(r))
