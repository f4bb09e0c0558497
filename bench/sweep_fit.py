"""The sweep's math, pure functions of values (no I/O): least-squares cost lines over bytes
per rank, each world's fitted seconds at a common bytes per rank (is it flat in world
size?), and the planner across GPU counts through ``tierckpt.policy.plan`` — the same
``job_mtbf`` and ``plan_interval`` (Young, waste by part) that ``tierckpt plan`` uses.

The failure rate is Llama 3's (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.4):
419 unexpected interruptions in a 54-day snapshot on 16,384 GPUs, a job MTBF of 3.09 h,
so a per-GPU MTBF of 16,384 × 3.09 h (failures independent and spread evenly over GPUs).
"""

from __future__ import annotations

import statistics
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.policy import plan as planlib

METRICS = ("C", "durable", "restore_cold")
"""The timed metrics of a sweep point, each a ``bench.measure.Measurement`` dict."""

LLAMA3_GPUS, LLAMA3_INTERRUPTIONS, LLAMA3_DAYS = 16384, 419, 54
LLAMA3_JOB_MTBF_S = LLAMA3_DAYS * 86400 / LLAMA3_INTERRUPTIONS
GPU_MTBF_S = LLAMA3_GPUS * LLAMA3_JOB_MTBF_S
GPUS = (1, 8, 64, 512, 2048, 8192, 16384)
BYTES_PER_GPU = planlib.checkpoint_size(405 * 10**9, nodes=LLAMA3_GPUS).per_rank_bytes
BYTES_PER_GPU_BASIS = ("Llama 3 405B's share at 16,384 GPUs: 405e9 params × 14 B/param (bf16 "
                       "weights, fp32 master, Adam) / 16,384, held fixed per GPU at every "
                       "GPU count (weak scaling: the model grows with the job)")


# ----------------------------------------------------------------------------- the fits


def fit_line(xs: list[float], ys: list[float]) -> dict[str, Any] | None:
    """Least squares ``y = intercept + slope · x``, with r²; None below two distinct xs."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"intercept": intercept, "slope": slope, "points": len(xs),
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0}


def _value(p: dict[str, Any], metric: str) -> float:
    return float(p["ram"]["peak_extra_bytes"] if metric == "ram" else p[metric]["seconds"])


def fit_points(points: list[dict[str, Any]], worlds: tuple[int, ...]
               ) -> dict[str, dict[str, Any]]:
    """Per world and metric (``METRICS`` and ``ram``), the line over bytes per rank; seconds
    metrics also get ``rate_gbps`` (1 / slope; None when the slope is not positive)."""
    out: dict[str, dict[str, Any]] = {}
    for world in worlds:
        measured = [p for p in points if p["world"] == world and "skipped" not in p]
        xs = [float(p["bytes_per_rank"]) for p in measured]
        out[str(world)] = {}
        for metric in (*METRICS, "ram"):
            fit = fit_line(xs, [_value(p, metric) for p in measured])
            if fit is not None and metric != "ram":
                fit["rate_gbps"] = 1e-9 / fit["slope"] if fit["slope"] > 0 else None
            out[str(world)][metric] = fit
    return out


def predict(fit: dict[str, Any], bytes_per_rank: float) -> float:
    """The fitted line at ``bytes_per_rank``."""
    return float(fit["intercept"] + fit["slope"] * bytes_per_rank)


def flatness(points: list[dict[str, Any]], fits: dict[str, dict[str, Any]]
             ) -> dict[str, Any]:
    """Each world's fitted seconds at one bytes per rank that every world reached (the
    smallest of the worlds' largest), and the ratio to the first world's."""
    tops = [max((p["bytes_per_rank"] for p in points if p["world"] == int(w)
                 and "skipped" not in p), default=0) for w in fits]
    ref = min(tops, default=0)
    out: dict[str, Any] = {"bytes_per_rank": ref, "metrics": {}}
    if ref <= 0:
        return out
    for metric in METRICS:
        at = {w: predict(f[metric], ref) for w, f in fits.items() if f[metric] is not None}
        first = next(iter(at.values()), None)
        out["metrics"][metric] = {w: {"seconds": s, "vs_first": s / first if first else None}
                                  for w, s in at.items()}
    return out


# ------------------------------------------------------------------------- the planner


def planner_scale(C_s: float, R_s: float, W_s: float = 0.0, *,
                  gpus: tuple[int, ...] = GPUS, gpu_mtbf_s: float = GPU_MTBF_S
                  ) -> list[dict[str, Any]]:
    """τ (Young, as ``tierckpt plan``) and its first-order waste C/τ + (τ/2 + W)/M + R/M by
    part, per GPU count, with job MTBF M = ``gpu_mtbf_s`` / GPUs. Pure; ConfigError for an
    empty ``gpus`` or C, R, W the planner refuses."""
    if not gpus:
        raise ConfigError("gpus: give at least one GPU count, e.g. (1, 8, 64)")
    rows = []
    for n in gpus:
        M = planlib.job_mtbf(gpu_mtbf_s, n)
        p = planlib.plan_interval(C_s, M, R_s, W=W_s, rule=planlib.Rule.YOUNG)
        rows.append({"gpus": n, "job_mtbf_s": M, "interval_s": p.interval_s,
                     "daly_interval_s": p.daly_s, "waste": p.waste.total,
                     "waste_parts": {"ckpt": p.waste.ckpt, "rework": p.waste.rework,
                                     "restart": p.waste.restart},
                     "exact_waste": p.exact_waste_fraction, "overlap": p.overlap,
                     "llama3": n == LLAMA3_GPUS})
    return rows


def planner_costs(sweep: dict[str, Any], bytes_per_gpu: int = BYTES_PER_GPU
                  ) -> dict[str, Any]:
    """C, W, R at ``bytes_per_gpu`` from the first world with all three fits: C and
    restore from their lines (never below the 1 MiB point's), W = durable − C, R = process
    start (interpreter, imports, process group) + manager open + restore: a lower bound,
    with no failure detection, scheduler or rendezvous at scale. ``{"skipped": reason}``
    when no world has the fits."""
    for w, f in sweep["fits"].items():
        tiny = sweep["fixed"].get(w, {})
        if any(f[m] is None for m in METRICS) or "skipped" in tiny:
            continue
        C = max(predict(f["C"], bytes_per_gpu), tiny["C"]["seconds"])
        durable = max(predict(f["durable"], bytes_per_gpu), tiny["durable"]["seconds"], C)
        restore = max(predict(f["restore_cold"], bytes_per_gpu),
                      tiny["restore_cold"]["seconds"])
        R = sweep["process_start_seconds"][w] + tiny["manager_open_seconds"] + restore
        return {"world": int(w), "bytes_per_gpu": bytes_per_gpu, "basis": BYTES_PER_GPU_BASIS,
                "C_s": C, "W_s": durable - C, "R_s": R, "restore_s": restore,
                "note": f"from the world-{w} fits on this machine (its memory and disk "
                        "bandwidth); R is process start + manager open + cold restore only"}
    return {"skipped": "needs a world with at least two measured sizes and its 1 MiB point"}
