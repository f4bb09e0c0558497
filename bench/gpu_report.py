"""The results of ``python -m bench.gpu`` as files and as a Markdown table.

Contract: the input is the results dict that :func:`bench.gpu.run` builds (schema
``bench.gpu.SCHEMA``, laid out in that module's docstring), possibly partial: a section
missing, or ``{error}`` in its place, when a run was cut short. :func:`render_markdown`
reads nothing but that dict, so old results re-render; :func:`write_results` writes
``<stamp>-gpu.json`` (the dict) and ``<stamp>-gpu.md`` (its table). ``bench.gpu`` calls it
after every section, so the files always hold what was measured so far. Nothing here
measures anything or imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(r: dict[str, Any], out_dir: Path, stamp: str) -> tuple[Path, Path]:
    """``<stamp>-gpu.json`` and ``<stamp>-gpu.md`` in ``out_dir``; both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    j, m = out_dir / f"{stamp}-gpu.json", out_dir / f"{stamp}-gpu.md"
    j.write_text(json.dumps(r, indent=2) + "\n")
    m.write_text(render_markdown(r))
    return j, m


# --- the table ---------------------------------------------------------------------------------

def _g(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}g}"


def render_markdown(r: dict[str, Any]) -> str:
    """The results dict as Markdown; reads nothing else, so old results re-render."""
    cuda = r["config"]["device"] == "cuda"
    where = "cuda" if cuda else "CPU stand-in"
    d = r["device"]
    lines = [f"# GPU bench ({r['started']}, --device {r['config']['device']}, "
             f"{r['config']['mib']} MiB)", ""]
    if cuda:
        lines += [f"{d.get('name')} (sm {d.get('capability')}, {d.get('count')} visible), "
                  f"torch {d['torch']} (CUDA {d['torch_cuda']}, NCCL {d.get('nccl')}), "
                  f"{d['cores']} cores.", ""]
    else:
        lines += ["**CPU mode: every number below is a CPU stand-in** (column *measured on*); "
                  "the CUDA calls were replaced:", ""]
        lines += [f"- `{k}`: {v}" for k, v in (r.get("cpu_mode") or {}).items()]
        lines += ["", f"torch {d['torch']}, {d['cores']} cores ({d['cpu_model']}).", ""]
    lines += ["| section | measurement | seconds | GB/s | vs | measured on |",
              "|---|---|---|---|---|---|"]
    sec = r["sections"]
    lines += _d2h_rows(sec.get("d2h"), where)
    lines += _blocking_rows(sec.get("blocking"), where)
    lines += _resume_rows(sec.get("fsdp_resume"), where)
    if r["errors"]:
        lines += ["", "Errors: " + "; ".join(e["section"] for e in r["errors"])
                  + " (tracebacks in the JSON)."]
    return "\n".join([*lines, ""])


def _d2h_rows(s: dict[str, Any] | None, where: str) -> list[str]:
    if not s:
        return []
    if "error" in s:
        return [f"| d2h | failed: {s['error']} | | | | {where} |"]
    met = {True: "met", False: "**missed**", None: "target n/a on CPU"}[s["met"]]
    p, st, ob, ol = s["plain"], s["stage_sync"], s["overlap_blocked"], s["overlap_landed"]
    rows = [f"| d2h | plain copy, {s['bytes'] / 2**20:.0f} MiB in one tensor | "
            f"{_g(p['seconds'])} | {_g(p['gbps'])} | ceiling | {where} |",
            f"| d2h | HostStager.stage, {s['tensors']} tensors | {_g(st['seconds'])} | "
            f"{_g(st['gbps'])} | {_g(s['ratio'], 2)}× of plain (target ≥ {s['target']}: "
            f"{met}) | {where} |",
            f"| d2h | stage(defer=all): blocked | {_g(ob['seconds'])} | | | {where} |",
            f"| d2h | stage(defer=all): ready | {_g(ol['seconds'])} | {_g(ol['gbps'])} | "
            f"{_g(p['seconds'] / ol['seconds'] if ol['seconds'] else None, 2)}× of plain | "
            f"{where} |"]
    o = s["ordered"]
    checks = (f"host copy holds writes queued just before stage(): sync {o['sync']}, overlap "
              f"{o['overlap']}; no allocation after the first: {s['allocations_steady']}; "
              f"process CPU/wall while overlapped: {_g(min(s['overlap_cpu_per_wall']), 2)}")
    if s.get("pinned_reserved_bytes"):
        checks += f"; pinned reserved {s['pinned_reserved_bytes'] / s['bytes']:.2f}× the bytes"
    return [*rows, f"| d2h | {checks} | | | | {where} |"]


def _blocking_rows(s: dict[str, Any] | None, where: str) -> list[str]:
    if not s:
        return []
    if "error" in s:
        return [f"| blocking | failed: {s['error']} | | | | {where} |"]
    m = s["model"]
    rows = [f"| blocking | step without a save ({m['params'] / 1e6:.1f} M params, "
            f"{s['bytes'] / 2**20:.0f} MiB state, batch {m['batch']}) | "
            f"{_g(s['step_seconds']['seconds'])} | | | {where} |"]
    for v in s["variants"].values():
        if "error" in v:
            rows.append(f"| blocking | {v['note']}: failed: {v['error']} | | | | {where} |")
            continue
        b = v["blocked"]
        vs = f"{_g(v['vs_dcp_default'], 2)}× DCP default, {_g(v['vs_best_dcp'], 2)}× best DCP"
        rows.append(f"| blocking | C: {v['note']} (call {_g(v['best_call'])} + wait "
                    f"{_g(v['best_wait'])}; step lost {_g(v['best_lost'])} s) | "
                    f"{_g(b['seconds'])} | {_g(b['gbps'])} | {vs} | {where} |")
    return rows


def _resume_rows(s: dict[str, Any] | None, where: str) -> list[str]:
    if not s:
        return []
    if "error" in s:
        return [f"| fsdp_resume | failed: {s['error'].splitlines()[0]} | | | | {where} |"]
    meta = s["meta"][0] if s["meta"] else {}
    tol = "bit for bit" if s["tolerance"]["mode"] == "exact" else \
        f"rtol {s['tolerance']['rtol']:g}"
    verdict = "**ok**" if s["ok"] else "**FAILED**"
    return [f"| fsdp_resume | killed after step {s['killed_after']}, resumed from "
            f"{s['restored_step']}: {s['compared']} losses vs reference ({tol}): {verdict}; "
            f"bit-identical: {s['bit_identical']}; max diff {s['max_abs_diff']:.3g} abs, "
            f"{s['max_rel_diff']:.3g} rel; {meta.get('backend')} + checkpoint group "
            f"{meta.get('checkpoint_backend')} | {_g(s['seconds'])} | | | {where} |"]
