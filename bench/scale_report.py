"""The scale results (``bench.scale``) as ``<stamp>-scale.json``, a Markdown file of tables
and one PNG of four log-log panels: collectives per save and restore against W (real runs),
bytes per rank against W (real runs), coordinator seconds against W (synthetic), and bytes
at the coordinator and per rank against W (synthetic; scaled points drawn hollow).

JSON layout (bytes, seconds)::

    schema, started, finished, wall_seconds, machine, code {tierckpt, commit, changed, label}
    real      {layers, width, worlds, points [{world, commit_s, wall_seconds,
               tierckpt {save, restore, open}, dcp {save, restore}} | {world, skipped}]}
              each operation: {collectives, by_kind, coordinator_received, coordinator_sent,
              other_received_max (None at W=1), per_rank [{collectives, sent, received}],
              restores also metadata_read_max, metadata_read_min, metadata_read_by_file,
              metadata_read_rank, shard_files_max, metadata_read_other_max,
              metadata_read_other_by_file (ranks but 0; None at W = 1),
              metadata_read_owner, metadata_read_owner_by_file (rank 0)}
    synthetic {layers, tensors, item_cap, points [{world, layers_built, scaled,
               validate {measured, per_shape, estimate_seconds}, seconds {phase: s},
               dcp_coordinator_seconds, tierckpt_commit_seconds, restore_rank_seconds,
               coordinator_peak_bytes, restore_peak_bytes, metadata_bytes, manifest_bytes,
               gathered_plan_bytes, gathered_result_bytes, file_list_bytes,
               scatter_rank1_bytes, broadcast_payload_bytes, restore_read_bytes_per_rank,
               save_received_bytes_per_rank, manifest_over_read_limit,
               manifest_over_manifest_limit, rank_metadata_bytes, records_bytes,
               manifest_now_bytes, now_coordinator_seconds, now_coordinator_peak_bytes,
               now_received_bytes, owner_received_bytes, now_owner_received_bytes,
               marker_bytes, part_bytes, part_restore_read_bytes_per_rank,
               owner_restore_read_bytes_per_rank,
               manifest_owner_restore_read_bytes_per_rank (an owner up to 7d06d96),
               header_bytes, part_restore_seconds,
               replan_coordinator_seconds,
               rank_restore_read_bytes_per_rank, rank_restore_seconds, wall_seconds,
               raw {at_layers, at_0}: the two measured points before scaling}]}
    errors    [str]

``render_markdown`` reads only that dict, so a results file can be re-rendered later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.sweep_report import write_results

MiB = 1 << 20


def _b(n: int | None) -> str:
    """Bytes for a table: exact below 10 KiB, else KiB / MiB / GiB."""
    if n is None:
        return "—"
    if n < 10 << 10:
        return f"{n:,}"
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):,.1f} {unit}"
    return str(n)


def _s(x: float) -> str:
    return f"{x:,.3g}" if x < 1000 else f"{x:,.0f}"


def _kinds(by_kind: dict[str, int]) -> str:
    short = {"all_gather_object": "ag", "gather_object": "g", "scatter_object_list": "sc",
             "broadcast_object_list": "bc", "all_reduce": "ar", "barrier": "bar"}
    return " ".join(f"{short.get(k, k)}×{v}" for k, v in sorted(by_kind.items()))


def _real(r: dict[str, Any]) -> list[str]:
    pts = [p for p in r["real"]["points"] if "skipped" not in p]
    skipped = [p for p in r["real"]["points"] if "skipped" in p]
    head = (f"## Real gloo runs (tiny FSDP2 model: {r['real']['layers']} × Linear("
            f"{r['real']['width']}, {r['real']['width']}) + AdamW; counted, one save after "
            "a warm-up, one restore by a fresh manager)")
    lines = [head, "",
             "Bytes are pickled sizes through the collectives (`tierckpt.runtime.commcount`);"
             " *coordinator* is rank 0, *other* the most any other rank received. "
             "tierckpt | plain DCP in each cell.", "",
             "### Save", "",
             "| W | collectives | coordinator received | other rank received | "
             "commit round trip ms (noisy) |", "|---|---|---|---|---|"]
    for p in pts:
        t, d = p["tierckpt"]["save"], p["dcp"]["save"]
        lines.append(f"| {p['world']} | {t['collectives']} \\| {d['collectives']} | "
                     f"{_b(t['coordinator_received'])} \\| {_b(d['coordinator_received'])} | "
                     f"{_b(t['other_received_max'])} \\| {_b(d['other_received_max'])} | "
                     f"{p['commit_s'] * 1e3:.1f} |")
    lines += ["", "### Restore", "",
              "Metadata read per rank: every file other than shard data that a rank opened "
              "below the checkpoint (read whole), the most over ranks; the files of that "
              "rank; shard files: the most any rank opened. *Ranks but 0*: the most any "
              "rank other than the domain's owner read, tierckpt only (rank 0: it verifies "
              "its domain from the domain's manifest parts, and reads the marker and its "
              "part twice; one simulated node here, so its domain is all W ranks).", "",
              "| W | collectives | coordinator received | other rank received | "
              "metadata read per rank | its files (tierckpt) | ranks but 0 | their files | "
              "shard files |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in pts:
        t, d = p["tierckpt"]["restore"], p["dcp"]["restore"]
        files = ", ".join(f"{k} {_b(v)}" for k, v in sorted(t["metadata_read_by_file"].items()))
        others = ", ".join(f"{k} {_b(v)}" for k, v in
                           sorted((t.get("metadata_read_other_by_file") or {}).items())) or "—"
        lines.append(f"| {p['world']} | {t['collectives']} \\| {d['collectives']} | "
                     f"{_b(t['coordinator_received'])} \\| {_b(d['coordinator_received'])} | "
                     f"{_b(t['other_received_max'])} \\| {_b(d['other_received_max'])} | "
                     f"{_b(t['metadata_read_max'])} \\| {_b(d['metadata_read_max'])} | "
                     f"{files} | {_b(t.get('metadata_read_other_max'))} | {others} | "
                     f"{t['shard_files_max']} \\| {d['shard_files_max']} |")
    lines += ["", "### Collectives by kind (ag all-gather, g gather, sc scatter, bc broadcast,"
              " ar all-reduce)", "",
              "| W | tierckpt save | tierckpt restore | tierckpt open | DCP save | DCP load |",
              "|---|---|---|---|---|---|"]
    for p in pts:
        t, d = p["tierckpt"], p["dcp"]
        lines.append(f"| {p['world']} | {_kinds(t['save']['by_kind'])} | "
                     f"{_kinds(t['restore']['by_kind'])} | {_kinds(t['open']['by_kind'])} | "
                     f"{_kinds(d['save']['by_kind'])} | {_kinds(d['restore']['by_kind'])} |")
    lines += [f"| {p['world']} | skipped: {p['skipped']} | | | | |" for p in skipped]
    return [*lines, ""]


def _synthetic(r: dict[str, Any]) -> list[str]:
    s = r["synthetic"]
    lines = [f"## Synthetic planning (Llama-70B shape: {s['tensors']} parameters × (param, "
             "exp_avg, exp_avg_sq) sharded W ways, in one process)", "",
             "*Scaled*: built with fewer than 80 layers (and with 0) and scaled linearly to "
             "80 (`bench/scale_synth.py`; the `planner_data` merge is measured on full-size "
             "maps instead); *est.*: validation timed on one key per shape × the keys of "
             "that shape. Coordinator peak: tracemalloc over DCP's path and the manifest. "
             "Per-rank restore read = `.metadata` + `manifest.json` (every rank read both "
             "before the rank files); on the saved layout since: `manifest.json` + the "
             "rank's own `__<rank>.metadata` (the manifest since lists each rank's shard "
             "file, `__<rank>.metadata` and `__<rank>.records`, no per-record CRC32Cs: "
             "those are in `__<rank>.records`, read only for a reshard or a ranged read; "
             "its shard sizes are the full state's, so it is not scaled); received per rank "
             "on save (up to fd5185e): a "
             "non-coordinator's scattered plan, every rank's file list (all-gather) and "
             "the manifest, marker and `.metadata` "
             "(broadcast), as `save/saver.py` sent them up to fd5185e. Cyclic GC off while "
             "timing. *Coordinator since*: a save with the plan cached and no rank's "
             "records changed (the steady state): W digests and file entries received, the "
             "manifest built, the previous `.metadata` bytes written again; *to each owner*: "
             "what a domain owner receives per save, before (manifest, marker, `.metadata`) "
             "→ since (manifest, marker, the digest of the `.metadata` it holds). *Since "
             "the parts*: what a rank reads on a same-layout restore — a rank that is "
             "not its domain's owner: `COMPLETE` (every part's SHA-256), its part "
             "`manifest.<k>.json` (8 ranks' entries) and its `__<rank>.metadata`; an owner "
             "(it verifies its domain) before → since: the whole manifest besides → the "
             "marker again, the first part (the header) and its own part again. "
             "*Replanning save "
             "since*: DCP's coordinator with `_torch/planner.py`'s validation and merge (the "
             "first save of a run, or a new layout).", "",
             "| W | layers built | DCP coordinator s | of which validate s | coordinator "
             "peak | tierckpt manifest s | .metadata | manifest.json | read per rank on "
             "restore | parse per rank s | manifest.json since | __<rank>.metadata | "
             "__<rank>.records | read per rank, saved layout | parse per rank, saved layout s "
             "| received per rank on save | coordinator since: s | peak | received | "
             "to each owner: before → since | replanning save since s | since the parts: "
             "read per rank \\| owner: before → since | parse per rank s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
             "---|---|---|"]
    for p in s["points"]:
        val = p["seconds"]["dcp.validate"]
        est = "" if p["validate"]["measured"] else " est."
        over = " (over the 1 GiB manifest limit)" if p.get("manifest_over_manifest_limit") \
            else " (over 64 MiB: the old limit)" if p["manifest_over_read_limit"] else ""
        lines.append(
            f"| {p['world']:,} | {p['layers_built']}{' scaled' if p['scaled'] else ''} | "
            f"{_s(p['dcp_coordinator_seconds'])} | {_s(val)}{est} | "
            f"{_b(p['coordinator_peak_bytes'])} | {_s(p['tierckpt_commit_seconds'])} | "
            f"{_b(p['metadata_bytes'])} | {_b(p['manifest_bytes'])}{over} | "
            f"{_b(p['restore_read_bytes_per_rank'])} | {_s(p['restore_rank_seconds'])} | "
            f"{_b(p.get('manifest_now_bytes'))} | {_b(p.get('rank_metadata_bytes'))} | "
            f"{_b(p.get('records_bytes'))} | "
            f"{_b(p.get('rank_restore_read_bytes_per_rank'))} | "
            f"{_s(p['rank_restore_seconds']) if 'rank_restore_seconds' in p else '—'} | "
            f"{_b(p['save_received_bytes_per_rank'])} | "
            f"{_s(p['now_coordinator_seconds']) if 'now_coordinator_seconds' in p else '—'} | "
            f"{_b(p.get('now_coordinator_peak_bytes'))} | {_b(p.get('now_received_bytes'))} | "
            f"{_b(p.get('owner_received_bytes'))} → {_b(p.get('now_owner_received_bytes'))} | "
            f"{_s(p['replan_coordinator_seconds']) if 'replan_coordinator_seconds' in p else '—'}"
            f" | {_b(p.get('part_restore_read_bytes_per_rank'))} \\| "
            f"{_b(p.get('manifest_owner_restore_read_bytes_per_rank'))} → "
            f"{_b(p.get('owner_restore_read_bytes_per_rank'))} | "
            f"{_s(p['part_restore_seconds']) if 'part_restore_seconds' in p else '—'} |")
    phases = list(s["points"][0]["seconds"]) if s["points"] else []
    lines += ["", "### Seconds by phase", "",
              "| W | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
    for p in s["points"]:
        lines.append(f"| {p['world']:,} | "
                     + " | ".join(_s(p["seconds"].get(k, 0.0)) for k in phases) + " |")
    lines += ["", "### Validation per shape (seconds for one key, keys in the state)", "",
              "| W | " + " | ".join(s["points"][0]["validate"]["per_shape"]) + " |"
              if s["points"] else "| W |",
              "|---" * (1 + len(s["points"][0]["validate"]["per_shape"] if s["points"]
                                else {})) + "|"]
    for p in s["points"]:
        ps = p["validate"]["per_shape"]
        lines.append(f"| {p['world']:,} | " + " | ".join(
            f"{v['seconds_per_key'] * 1e3:.3g} ms"
            + (f" (since {v['ours_seconds_per_key'] * 1e3:.3g} ms)"
               if "ours_seconds_per_key" in v else "") + f" × {v['keys']}"
            for v in ps.values()) + " |")
    return [*lines, ""]


def render_markdown(r: dict[str, Any]) -> str:
    """Every table of the results dict, as Markdown."""
    code = r.get("code", {})
    changed = code.get("changed") or []
    what = (f"**{code['label']}** — " if code.get("label") else "") + \
        f"tierckpt at {code.get('commit', '?')}" + (
        f" with {len(changed)} changed file(s) under src/" if changed else "") + \
        f" ({code.get('tierckpt', '?')})"
    lines = [f"# tierckpt scale — {r['started']}", "",
             f"Measured: {what}; {r['wall_seconds']:.0f} s; load average at start "
             f"{r['machine'].get('loadavg_start', '?')}.", ""]
    lines += _real(r) + _synthetic(r)
    if r["errors"]:
        lines += ["## Errors", "", *(f"- {e}" for e in r["errors"]), ""]
    return "\n".join(lines)


def _loglog(ax: Any, title: str, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("world size W")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2 if len(ax.get_lines()) > 10 else 1)


def _positive(ax: Any, pts: list[dict[str, Any]], value: Any, style: str, marker: str,
              label: str) -> None:
    """Plot ``value(p)`` against W where it is a positive number (log axes; a coordinator
    receives nothing at W = 1, another rank does not exist)."""
    xy = [(p["world"], value(p)) for p in pts]
    xy = [(w, v) for w, v in xy if v]
    ax.plot([w for w, _ in xy], [v for _, v in xy], style, marker=marker, label=label)


def _plot_real(ax_calls: Any, ax_bytes: Any, r: dict[str, Any]) -> None:
    pts = [p for p in r["real"]["points"] if "skipped" not in p]
    for side, style in (("tierckpt", "-"), ("dcp", "--")):
        for op, marker in (("save", "o"), ("restore", "s")):
            _positive(ax_calls, pts, lambda p, s=side, o=op: p[s][o]["collectives"], style,
                      marker, f"{side} {op}")
        _positive(ax_bytes, pts, lambda p, s=side: p[s]["restore"]["metadata_read_max"],
                  style, "s", f"{side} metadata read per rank (restore)")
        _positive(ax_bytes, pts, lambda p, s=side: p[s]["save"]["coordinator_received"],
                  style, "o", f"{side} coordinator received (save)")
        _positive(ax_bytes, pts, lambda p, s=side: p[s]["save"]["other_received_max"],
                  style, "^", f"{side} other rank received (save)")
    _positive(ax_bytes, pts, lambda p: p["tierckpt"]["restore"].get("metadata_read_other_max"),
              "-", "*", "tierckpt metadata read, ranks but the owner (restore)")
    _loglog(ax_calls, "real: collectives per operation", "collectives")
    _loglog(ax_bytes, "real: bytes per rank", "bytes")


def _plot_synthetic(ax_s: Any, ax_b: Any, r: dict[str, Any]) -> None:
    pts = r["synthetic"]["points"]
    ws = [p["world"] for p in pts]

    def line(ax: Any, ys: list[float], label: str, marker: str) -> None:
        line = ax.plot(ws, ys, "-", label=label)[0]
        for w, y, p in zip(ws, ys, pts, strict=True):  # hollow: scaled from fewer layers
            ax.plot([w], [y], marker, color=line.get_color(),
                    markerfacecolor="none" if p["scaled"] else line.get_color())

    def series(ax: Any, key: str, label: str, marker: str) -> None:
        if all(key in p for p in pts):  # a quantity older results lack is left out
            line(ax, [p[key] for p in pts], label, marker)

    series(ax_s, "dcp_coordinator_seconds", "DCP coordinator (save)", "o")
    line(ax_s, [p["seconds"]["dcp.validate"] for p in pts], "… of which validation", "v")
    for key, label, marker in (
            ("tierckpt_commit_seconds", "tierckpt manifest (save)", "s"),
            ("replan_coordinator_seconds", "coordinator since, replanning save", "D"),
            ("restore_rank_seconds", "per rank: parse (restore)", "^"),
            ("now_coordinator_seconds", "coordinator since (cached save)", "x"),
            ("rank_restore_seconds", "per rank since: parse (saved layout)", ">")):
        series(ax_s, key, label, marker)
    ax_s.axhline(1.0, color="grey", lw=0.8, ls=":", label="target: coordinator 1 s")
    for key, label, marker in (
            ("coordinator_peak_bytes", "coordinator peak (save)", "o"),
            ("now_coordinator_peak_bytes", "coordinator peak since (cached save)", "P"),
            ("metadata_bytes", ".metadata", "v"),
            ("manifest_bytes", "manifest.json", "s"),
            ("manifest_now_bytes", "manifest.json since", "x"),
            ("restore_read_bytes_per_rank", "read per rank (restore)", "^"),
            ("rank_restore_read_bytes_per_rank", "read per rank, saved layout (rank files)",
             ">"),
            ("rank_metadata_bytes", "__<rank>.metadata", "<"),
            ("part_restore_read_bytes_per_rank",
             "read per rank since the parts (not an owner)", "*"),
            ("owner_restore_read_bytes_per_rank",
             "read per domain owner since it verifies from the parts", "X"),
            ("now_owner_received_bytes", "to each owner since (cached save)", "h"),
            ("save_received_bytes_per_rank", "received per rank (save)", "D")):
        series(ax_b, key, label, marker)
    ax_b.axhline(100e6, color="grey", lw=0.8, ls=":", label="target: coordinator 100 MB")
    ax_b.axhline(1e6, color="grey", lw=0.8, ls="-.", label="target: 1 MB read per rank")
    _loglog(ax_s, "synthetic 70B: seconds (hollow: scaled)", "seconds")
    _loglog(ax_b, "synthetic 70B: bytes (hollow: scaled)", "bytes")


def plot(r: dict[str, Any], path: Path) -> Path:
    """Draw the four panels into ``path`` (PNG, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    _plot_real(axes[0][0], axes[0][1], r)
    _plot_synthetic(axes[1][0], axes[1][1], r)
    fig.suptitle(f"tierckpt scale — {r['started']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_scale(r: dict[str, Any], out_dir: Path, stamp: str) -> tuple[Path, Path, Path]:
    """Write ``<stamp>-scale.json``, ``.md`` and ``.png`` into ``out_dir``; return the paths."""
    return write_results(r, out_dir / f"{stamp}-scale", plot, render_markdown)
