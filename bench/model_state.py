"""What a save blocks for, and what a restore costs, when the state is a real model's:
hundreds of tensors, not a few large ones.

The main bench state (``bench.state``) is 187 large-ish frozen tensors without optimizer
state, which measures bytes. A transformer with AdamW is different: 24 layers are 288
parameters and 864 optimizer tensors, most of them small (biases, norms, Adam ``step``
scalars), and per-tensor work (``get_state_dict``'s key renaming, the per-rank blob, one
copy hand-off per tensor) can cost more than the copy. One spawned rank (gloo, one torch
thread), a ``torch.nn.TransformerEncoderLayer`` stack (width from the size asked for, FFN 2×
width) after one AdamW step; per repeat, the order alternating:

- ``tierckpt_overlap``: ``save()`` with ``staging="overlap"`` (the default), then the next
  step, whose ``optimizer.step()`` waits for the background copy if it is still running:
  blocked = ``save()`` + that wait (``handle.staged``, what tierckpt reports as C).
- ``tierckpt_sync``: ``save()`` with ``staging="sync"`` (copies everything first).
- ``dcp_async_save``: ``get_state_dict(model, optimizer)`` + ``dcp.async_save`` until it
  returns — torchtitan's checkpointer path, with DCP's default stager.
- ``memcpy``: one ``copy_`` of the same bytes as one flat tensor (the copy limit), and
  ``per_tensor_copy``: one ``copy_`` per tensor into ready buffers (the floor any stager that
  copies tensor by tensor pays).
- ``restore``: ``restore()`` of the newest checkpoint into a fresh model and optimizer, and
  DCP's ``dcp.load`` + ``set_state_dict`` of its own checkpoint of the same state (both from
  the page cache: this is the per-tensor cost, not the disk).

Every figure is the median of ``saves`` saves per repeat (best repeat; each save's seconds
kept). ``python -m bench.model_state [--mib 128] [--repeats 2]`` prints the table and JSON.
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench import _dist
from bench._cli import run_section
from tierckpt import Writes

MiB = 1 << 20
LAYERS = 24
SAVES = 8
_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW's exp_avg and exp_avg_sq
_PARAMS_PER_WIDTH2 = 8 * LAYERS  # in-proj 3w², out-proj w², FFN 2 × 2w², per layer


def width_for(total_bytes: int) -> int:
    """The model width (a multiple of 64, at least 64) whose state is about ``total_bytes``."""
    w = math.sqrt(total_bytes / _BYTES_PER_PARAM / _PARAMS_PER_WIDTH2)
    return max(64, round(w / 64) * 64)


def _model(width: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(width, max(1, width // 64), 2 * width,
                                                       dropout=0.0) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, 8, width)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    step()
    return model, opt, step


def _state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters and every optimizer-state tensor: what a checkpoint holds."""
    return [p.detach() for p in model.parameters()] + [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _tierckpt_saves(root: Path, staging: str, model: nn.Module, opt: torch.optim.Optimizer,
                    step: Callable[[], None], first: int) -> list[float]:
    import tierckpt

    ts = tierckpt.TrainState(model=model, optimizer=opt)
    out = []
    with tierckpt.CheckpointManager(tier1=root, keep_last=2,
                                    writes=Writes(staging=staging)) as ckpt:
        for s in range(first, first + SAVES):
            handle = ckpt.save(s, ts)
            step()  # overlap: its optimizer.step() waits for the background copy
            out.append(handle.staged.result())  # save() + that wait: C
            handle.wait()
    return out


def _dcp_saves(root: Path, model: nn.Module, opt: torch.optim.Optimizer,
               step: Callable[[], None]) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = []
    for s in range(SAVES):
        path = root / f"step-{s}"
        shutil.rmtree(path, ignore_errors=True)
        start = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        out.append(time.perf_counter() - start)
        step()
        future.result()
    return out


def _copies(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[float], list[float]]:
    tensors = _state_tensors(model, opt)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    flat_dst, dsts = torch.empty_like(flat), [torch.empty_like(t) for t in tensors]
    memcpy, each = [], []
    for _ in range(SAVES):
        start = time.perf_counter()
        flat_dst.copy_(flat)
        memcpy.append(time.perf_counter() - start)
        start = time.perf_counter()
        for d, t in zip(dsts, tensors, strict=True):
            d.copy_(t)
        each.append(time.perf_counter() - start)
    return memcpy, each


def _restores(tier1: Path, dcp_dir: Path, width: int) -> tuple[list[float], list[float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import tierckpt

    model, opt, _ = _model(width)
    ts = tierckpt.TrainState(model=model, optimizer=opt)
    ours, theirs = [], []
    for _ in range(SAVES // 2):
        with tierckpt.CheckpointManager(tier1=tier1, keep_last=2) as ckpt:
            start = time.perf_counter()
            if ckpt.restore(ts) is None:
                raise AssertionError(f"tierckpt restore found no checkpoint in {tier1}")
            ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(dcp_dir))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        theirs.append(time.perf_counter() - start)
    return ours, theirs


def _rank(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    work, width = Path(job["work"]), job["width"]
    model, opt, step = _model(width)
    idle = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        idle.append(time.perf_counter() - start)
    idle_step = statistics.median(idle)
    runs: dict[str, list[list[float]]] = {k: [] for k in (
        "tierckpt_overlap", "tierckpt_sync", "dcp_async_save", "memcpy", "per_tensor_copy",
        "restore_tierckpt", "restore_dcp")}
    first = 0  # steps keep increasing in the one tier-1 root
    for r in range(job["repeats"]):
        for which in ("tierckpt", "dcp") if r % 2 == 0 else ("dcp", "tierckpt"):
            if which == "dcp":
                runs["dcp_async_save"].append(_dcp_saves(work / "dcp", model, opt, step))
                continue
            for staging in ("overlap", "sync"):
                runs[f"tierckpt_{staging}"].append(_tierckpt_saves(
                    work / "tier1", staging, model, opt, step, first))
                first += SAVES
        memcpy, each = _copies(model, opt)
        runs["memcpy"].append(memcpy)
        runs["per_tensor_copy"].append(each)
        ours, theirs = _restores(work / "tier1", work / "dcp" / f"step-{SAVES - 1}", width)
        runs["restore_tierckpt"].append(ours)
        runs["restore_dcp"].append(theirs)
    tensors = _state_tensors(model, opt)
    return {"runs": runs, "idle_step_seconds": idle_step, "tensors": len(tensors),
            "params": sum(p.numel() for p in model.parameters()),
            "parameters": len(list(model.parameters())),
            "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def measure_model_state(work: Path, total_bytes: int, *, repeats: int = 2) -> dict[str, Any]:
    """The section, for a model whose state is about ``total_bytes``; JSON-able."""
    work.mkdir(parents=True, exist_ok=True)
    width = width_for(total_bytes)
    (r,) = _dist.run_ranks(1, _rank, {"work": str(work), "width": width, "repeats": repeats})
    med = {k: min(statistics.median(v) for v in per_repeat) for k, per_repeat in r["runs"].items()}
    out: dict[str, Any] = {
        "model": {"layers": LAYERS, "width": width, "params": r["params"],
                  "parameters": r["parameters"], "tensors": r["tensors"],
                  "state_bytes": r["state_bytes"]},
        "idle_step_seconds": r["idle_step_seconds"], "saves_per_repeat": SAVES,
        "seconds": med, "runs": r["runs"],
        "overlap_vs_dcp": med["tierckpt_overlap"] / med["dcp_async_save"],
        "sync_vs_dcp": med["tierckpt_sync"] / med["dcp_async_save"],
        "overlap_vs_memcpy": med["tierckpt_overlap"] / med["memcpy"],
        "sync_vs_memcpy": med["tierckpt_sync"] / med["memcpy"],
        "restore_vs_dcp": med["restore_tierckpt"] / med["restore_dcp"],
    }
    return out


def markdown(s: dict[str, Any]) -> list[str]:
    """The section as Markdown lines."""
    lines = ["## A real model's state: many small tensors (same run)", ""]
    if "skipped" in s:
        return [*lines, f"**Skipped:** {s['skipped']}", ""]
    m, sec = s["model"], s["seconds"]

    def ms(key: str) -> str:
        return f"{sec[key] * 1e3:.1f}"

    lines += [
        "| measurement | ms (median) | vs DCP | vs memcpy |", "|---|---|---|---|",
        f"| tierckpt `save()`, `staging='overlap'` (+ wait in the next step) | "
        f"{ms('tierckpt_overlap')} | {s['overlap_vs_dcp']:.2f}× | "
        f"{s['overlap_vs_memcpy']:.1f}× |",
        f"| tierckpt `save()`, `staging='sync'` | {ms('tierckpt_sync')} | "
        f"{s['sync_vs_dcp']:.2f}× | {s['sync_vs_memcpy']:.1f}× |",
        f"| `get_state_dict` + `dcp.async_save` | {ms('dcp_async_save')} | reference | "
        f"{sec['dcp_async_save'] / sec['memcpy']:.1f}× |",
        f"| one `copy_` per tensor (floor of a per-tensor copy) | {ms('per_tensor_copy')} | | "
        f"{sec['per_tensor_copy'] / sec['memcpy']:.1f}× |",
        f"| memcpy of the same bytes (copy limit) | {ms('memcpy')} | | reference |",
        f"| tierckpt `restore()` (page cache) | {ms('restore_tierckpt')} | "
        f"{s['restore_vs_dcp']:.2f}× | |",
        f"| `dcp.load` + `set_state_dict` (page cache) | {ms('restore_dcp')} | reference | |",
        "",
        f"{m['layers']} `TransformerEncoderLayer`s of width {m['width']} with AdamW: "
        f"{m['parameters']} parameters ({m['params'] / 1e6:.1f} M), {m['tensors']} tensors, "
        f"{m['state_bytes'] / MiB:.0f} MiB of state; an idle step takes "
        f"{s['idle_step_seconds'] * 1e3:.0f} ms.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.model_state``: run the section alone; print its table and JSON."""
    return run_section(
        argv, name="model_state", doc=__doc__, markdown=markdown,
        mib_help="state size in MiB (model + AdamW; sets the width)",
        measure=lambda a, work: measure_model_state(work, a.mib * MiB, repeats=a.repeats))


if __name__ == "__main__":
    sys.exit(main())
