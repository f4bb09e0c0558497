"""Incremental saves and content-addressed tier 2 on fine-tuning shapes, in one run.

Two states, each about ``total`` bytes of parameters, one process, world size 1:

- ``lora``: a frozen base of square fp32 layers (``requires_grad=False``) with a rank-``r``
  adapter pair on each, ``r`` chosen so the adapters are ~0.5 % of the base; AdamW on the
  adapters (its two moments are the adapters' size again, twice).
- ``frozen_embeddings``: a frozen embedding table of a quarter of the parameters, the rest
  trainable square layers with AdamW (optimizer state twice their size).

For each state, three ways to checkpoint it, every save after one step that changes the
trainable parameters (a synthetic gradient, ``optimizer.step()``):

- ``incremental``: ``CheckpointManager(tier1=…, tier2=…, writes=Writes(incremental=True))``;
- ``full``: the same without ``incremental`` (every byte staged, written and hashed; tier 2
  is content-addressed either way, so unchanged files are not uploaded again in both);
- ``dcp``: plain ``torch.distributed.checkpoint.save`` of the same state dict into a fresh
  directory (synchronous, no tier 2).

Then a *sibling*: a second fine-tune of the same base (its own adapters) under the same
tier-2 prefix as the ``incremental`` run (``?run=sibling`` beside ``?run=incremental``); its
first upload is reported against the first run's first (full) one.

The first save of each is the warm-up (it allocates the buffers and writes and uploads
everything); the ``repeats`` saves after it are measured and their median reported: ``C`` =
seconds ``save()`` blocked, ``durable`` = ``save()`` → committed on tier 1, bytes staged
(copied to host memory: the save's bytes less what the stager kept), bytes written to tier 1
(less what was hard-linked) and bytes uploaded to tier 2 (``upload_verified``'s ``bytes``;
each save is on tier 2 before the next step), each against the full save's. Tier 2 is
``$TIERCKPT_BENCH_S3_URL``, else a SeaweedFS on loopback (``bench.transfer.tier2``), else a
``file://`` directory.

``python -m bench.incremental [--mib 1024] [--repeats 2]`` prints the table and the JSON.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from bench._cli import SectionArgs, run_section
from bench.tier0 import tier2
from tierckpt import CheckpointManager, Tier2, TrainState, Writes
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog

MiB = 1 << 20
ADAPTER_SHARE = 0.005
SHAPES = ("lora", "frozen_embeddings")
MODES = ("incremental", "full", "dcp")


class Lora(nn.Module):
    """``layers`` frozen ``dim``×``dim`` layers, each with a trainable rank-``rank`` pair."""

    def __init__(self, layers: int, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.ParameterList(nn.Parameter(torch.randn(dim, dim), requires_grad=False)
                                     for _ in range(layers))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(rank, dim) * 0.01)
                                     for _ in range(layers))
        self.up = nn.ParameterList(nn.Parameter(torch.zeros(dim, rank)) for _ in range(layers))


class FrozenEmbeddings(nn.Module):
    """A frozen ``vocab``×``dim`` table and ``layers`` trainable ``dim``×``dim`` layers."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(vocab, dim), requires_grad=False)
        self.layers = nn.ParameterList(nn.Parameter(torch.randn(dim, dim) * 0.02)
                                       for _ in range(layers))


def build(shape: str, total: int) -> TrainState:
    """The ``shape``'s model (about ``total`` bytes of fp32 parameters) and AdamW on what
    trains."""
    torch.manual_seed(0)
    floats = max(1, total // 4)
    model: nn.Module
    if shape == "lora":
        layers = 8
        dim = max(8, int(math.sqrt(floats / layers)))
        rank = max(1, round(ADAPTER_SHARE * dim / 2))  # 2·dim·rank per layer ≈ 0.5 % of dim²
        model = Lora(layers, dim, rank)
    else:
        dim = max(8, int(math.sqrt(floats / 16)))
        model = FrozenEmbeddings(vocab=4 * dim, dim=dim, layers=12)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return TrainState(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-3))


def _step(st: TrainState) -> None:
    """One optimizer step with a synthetic gradient: only the trainable parameters change."""
    assert st.optimizer is not None
    for group in st.optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 1e-3)
    st.optimizer.step()


def _param_bytes(st: TrainState, *, frozen: bool) -> int:
    return sum(p.numel() * p.element_size() for p in st.model.parameters()
               if p.requires_grad != frozen)


def _manager_saves(st: TrainState, root: Path, url: str, *, incremental: bool,
                   saves: int) -> list[dict[str, Any]]:
    """Save ``saves`` times (a step before each) with tier 2 at ``url``; per save: C,
    durable, bytes staged, written and uploaded (after the drain at close)."""
    out = []
    with CheckpointManager(tier1=root, keep_last=2, tier2=Tier2(url, upload_every=1),
                           writes=Writes(incremental=incremental)) as ck:
        for step in range(saves):
            _step(st)
            t0 = time.monotonic()
            handle = ck.save(step, st)
            blocked = handle.staged.result()
            handle.wait()
            out.append({"step": step, "C_s": blocked, "durable_s": time.monotonic() - t0})
            _uploaded(root, step)  # each save reaches tier 2 before the next one
    log = events.read_events(root / layout.EVENTS)
    durable = {e["step"]: e for e in log if e["event"] == events.SAVE_DURABLE}
    staged = {e["step"]: e for e in log if e["event"] == events.SAVE_STAGED}
    uploaded = {e["step"]: e for e in log if e["event"] == events.UPLOAD_VERIFIED}
    for row in out:
        d, s = durable[row["step"]], staged[row["step"]]
        row["staged_bytes"] = int(s["bytes"]) - int(d.get("kept", 0))
        row["written_bytes"] = int(d["bytes"]) - int(d.get("linked", 0))
        up = uploaded.get(row["step"])
        row["uploaded_bytes"] = None if up is None else int(up["bytes"])
        row["referenced_bytes"] = None if up is None else int(up.get("referenced", up["bytes"]))
    return out


def _uploaded(root: Path, step: int, timeout_s: float = 300.0) -> None:
    """Wait until the uploader verified ``step`` on tier 2 (its tier-1 upload record)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = Tier1Catalog(root).uploads.upload_record(step)
        if record is not None and record.get("status") == "verified":
            return
        time.sleep(0.05)
    raise RuntimeError(f"step {step} of {root} not on tier 2 after {timeout_s:.0f} s")


def _dcp_saves(st: TrainState, root: Path, *, saves: int) -> list[dict[str, Any]]:
    """Plain ``dcp.save`` of the model and optimizer state, ``saves`` times."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = []
    for step in range(saves):
        _step(st)
        assert st.optimizer is not None
        model_sd, optim_sd = get_state_dict(st.model, st.optimizer)
        target = root / f"step-{step}"
        t0 = time.monotonic()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(target),
                 no_dist=True)
        seconds = time.monotonic() - t0
        written = sum(p.stat().st_size for p in target.iterdir())
        out.append({"step": step, "C_s": seconds, "durable_s": seconds,
                    "staged_bytes": written, "written_bytes": written,
                    "uploaded_bytes": None, "referenced_bytes": None})
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The saves after the warm-up, their medians."""
    later = rows[1:]
    return {"saves": rows, **{k: _median(later, k) for k in (
        "C_s", "durable_s", "staged_bytes", "written_bytes", "uploaded_bytes",
        "referenced_bytes")}}


def measure_incremental(work: Path, total: int, repeats: int = 2,
                        url: str | None = None) -> dict[str, Any]:
    """The section's JSON (see the module docstring); tier 2 under ``url`` when given."""
    shapes: dict[str, Any] = {}
    with tier2(work, url) as (url, server):
        for shape in SHAPES:
            modes: dict[str, Any] = {}
            for mode in MODES:
                st = build(shape, total)
                root = work / shape / mode
                if mode == "dcp":
                    rows = _dcp_saves(st, root, saves=repeats + 1)
                else:
                    where = f"{shape}-shared?run=incremental" if mode == "incremental" \
                        else f"{shape}-{mode}"
                    rows = _manager_saves(st, root, f"{url}/{where}",
                                          incremental=mode == "incremental",
                                          saves=repeats + 1)
                modes[mode] = _summary(rows)
                shutil.rmtree(root, ignore_errors=True)  # bounded disk: one mode's saves
            sibling = _sibling(build(shape, total), work / shape / "sibling",
                               f"{url}/{shape}-shared?run=sibling")
            st = build(shape, total)
            ratios = _ratios(modes)
            first = modes["incremental"]["saves"][0]["uploaded_bytes"]
            ratios["sibling_first_upload_vs_full"] = None if not first else \
                sibling["uploaded_bytes"] / first
            shapes[shape] = {"frozen_bytes": _param_bytes(st, frozen=True),
                             "trainable_bytes": _param_bytes(st, frozen=False),
                             "modes": modes, "sibling": sibling, "ratios": ratios}
    return {"server": server, "total_bytes": total, "repeats": repeats, "shapes": shapes}


def _sibling(st: TrainState, root: Path, url: str) -> dict[str, Any]:
    """The first save of a sibling fine-tune: the same base, its own trainable values."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in st.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 1e-3)
    [row] = _manager_saves(st, root, url, incremental=True, saves=1)
    shutil.rmtree(root, ignore_errors=True)
    return row


def _ratios(modes: dict[str, Any]) -> dict[str, float | None]:
    """Incremental ÷ full (and ÷ plain DCP) for the medians of the measured saves."""
    inc, full, plain = modes["incremental"], modes["full"], modes["dcp"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    return {"staged_vs_full": ratio(inc["staged_bytes"], full["staged_bytes"]),
            "written_vs_full": ratio(inc["written_bytes"], full["written_bytes"]),
            "uploaded_vs_full_save": ratio(inc["uploaded_bytes"], full["written_bytes"]),
            "durable_vs_full": ratio(inc["durable_s"], full["durable_s"]),
            "C_vs_full": ratio(inc["C_s"], full["C_s"]),
            "durable_vs_dcp": ratio(inc["durable_s"], plain["durable_s"])}


def _mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e6:.1f} MB"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f} s"


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}×"


def markdown(s: dict[str, Any]) -> list[str]:
    """The section as Markdown lines: per shape and mode the medians, then the ratios."""
    lines = ["## Incremental saves: frozen weights written and uploaded once (same run)", ""]
    if "skipped" in s:
        return [*lines, f"**Skipped:** {s['skipped']}", ""]
    lines += [f"Tier 2: {s['server']}; medians of {s['repeats']} saves after the first.", "",
              "| shape | mode | C | durable | staged | written to tier 1 | uploaded |",
              "|---|---|---|---|---|---|---|"]
    for shape, sh in s["shapes"].items():
        for mode, m in sh["modes"].items():
            lines.append(f"| {shape} | {mode} | {_s(m['C_s'])} | {_s(m['durable_s'])} | "
                         f"{_mb(m['staged_bytes'])} | {_mb(m['written_bytes'])} | "
                         f"{_mb(m['uploaded_bytes'])} |")
    lines += ["", "| shape | frozen | staged vs full | written vs full | uploaded vs a full "
              "save | durable vs full | durable vs plain DCP | a sibling's first upload vs "
              "the first run's |", "|---|---|---|---|---|---|---|---|"]
    for shape, sh in s["shapes"].items():
        r = sh["ratios"]
        share = sh["frozen_bytes"] / max(1, sh["frozen_bytes"] + sh["trainable_bytes"])
        lines.append(f"| {shape} | {share:.1%} of parameters | {_r(r['staged_vs_full'])} | "
                     f"{_r(r['written_vs_full'])} | {_r(r['uploaded_vs_full_save'])} | "
                     f"{_r(r['durable_vs_full'])} | {_r(r['durable_vs_dcp'])} | "
                     f"{_r(r.get('sibling_first_upload_vs_full'))} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    def measure(a: SectionArgs, work: Path) -> dict[str, Any]:
        return measure_incremental(work, a.mib * MiB, a.repeats)

    return run_section(argv, name="incremental", doc=__doc__, measure=measure,
                       markdown=markdown, mib_help="parameter bytes of each state")


if __name__ == "__main__":
    raise SystemExit(main())
