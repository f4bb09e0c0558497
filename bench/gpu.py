"""``python -m bench.gpu``: what only a CUDA machine can show, in one prepared run.

Run as ``python -m bench.gpu [--device cuda|cpu] [--mib N] [--out DIR] [--target DIR]
[--repeats R] [--sections d2h,blocking,fsdp_resume]``; ``bench/gpu.sh`` is the script for the
GPU machine. ``N`` MiB is the state of every section but the last: the bytes copied in ``d2h``
and the parameters + AdamW state of the model in ``blocking``. Three sections:

- ``d2h``: N MiB of device tensors shaped like that model's parameters and AdamW moments,
  staged by ``HostStager.stage`` (pinned buffers, reused: the first round allocates and is
  not timed) against the ceiling: one ``dst.copy_(src, non_blocking=True)`` of the same
  bytes from one device tensor into one preallocated pinned tensor, then
  ``torch.cuda.synchronize()``. Best of R after a warm-up; the ratio of rates has a target
  of >= ``D2H_TARGET``. Also the overlapped mode (``defer`` = everything): how long
  ``stage()`` blocked, when ``ready`` resolved, and the process's CPU time per wall second
  meanwhile (a thread spinning on the copy's event shows as ~1). ``ordered``: after writes
  to every source were queued and not waited for, the host copy (both modes) must hold the
  new values. On CUDA, ``pinned_reserved_bytes`` is what the pinned allocator added for the
  stager's buffers (it rounds blocks up to powers of two).
- ``blocking``: C on a CUDA model (pre-norm MLP blocks, AdamW) in a process group of one
  (``cpu:gloo,cuda:nccl``: DCP's ``async_save`` needs a CPU backend): tierckpt ``save()``
  with ``staging="sync"`` and ``"overlap"``, and ``dcp.async_save`` as shipped, with a reused
  ``DefaultStager`` (pinned + shared memory, staging before it returns) and with the same
  stager staging in the background. Every save is followed by a real forward/backward and
  ``optimizer.step()``; the first round of each variant is not timed (threads start, reused
  buffers are allocated), and each round starts synchronized and ends committed.
  ``blocked`` = the save call + any wait before the step (DCP: ``staging_completion``;
  tierckpt overlap: the wait inside its step pre-hook, timed between two hooks of ours
  around it); ``lost`` = the synchronized iteration's time minus that of an iteration
  without a save run just before it (what the save cost the step, contention included).
- ``fsdp_resume`` (``bench/gpu_resume.py``): ``bench/gpu_job.py`` under torchrun, world 1
  (NCCL allows one rank per GPU): FSDP2, tierckpt saving every few steps on its own gloo
  group; one run SIGKILLs itself after a committed save and is restarted by torchrun,
  restores and runs on; its losses are compared with an uninterrupted run launched at the
  same time. CPU: bit for bit. CUDA: within ``gpu_resume.CUDA_RESUME_RTOL`` (relative), with
  deterministic algorithms on; the largest difference and whether the losses were
  bit-identical anyway are reported.

``--device cpu`` runs all three with CPU stand-ins (CPU tensors, no pinning, gloo, no CUDA
stream); ``cpu_mode`` in the JSON lists each replacement, and the table marks those rows.

Output, rewritten after every section (a run cut short keeps what it measured) by
``bench/gpu_report.py``: ``<out>/<stamp>-gpu.json`` (schema ``SCHEMA``) and
``<stamp>-gpu.md``::

    schema, started, finished, wall_seconds, errors[]
    config   {device, mib, state_bytes, repeats, sections, target_dir}
    device   {requested, cuda_available, name, capability, memory_bytes, torch, torch_cuda,
              nccl, cores, cpu_model, mem_total_bytes, ...}
    cpu_mode null | {section: what replaced the CUDA call}
    sections {d2h: {bytes, tensors, plain, stage_sync, ratio, target, met, overlap_blocked,
                    overlap_landed, overlap_cpu_per_wall[], verified, ordered {sync, overlap},
                    allocations_steady, pinned_reserved_bytes},
              blocking: {bytes, model {dim, layers, batch, params}, step_seconds,
                         variants {name: {blocked, call[], wait[], lost[], base[], durable[],
                                          best_call, best_wait, best_lost, note,
                                          gate_blocked[]?, vs_dcp_default, vs_best_dcp}
                                         | {error, note}}},
              fsdp_resume: {ok, bit_identical, tolerance {mode, rtol}, compared, resumed_rows,
                            restored_step, killed_after, steps, save_every, max_abs_diff,
                            max_rel_diff, mismatches, missing, meta[], seconds}}
    (each section also has section_seconds, or is {error})

Exit status: 0 when every section ran and the resume verdict held, 1 otherwise (the error is
in ``errors``), 2 on bad arguments (``--device cuda`` without CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import tierckpt
from bench.gpu_report import render_markdown, write_results
from bench.gpu_resume import measure_fsdp_resume
from bench.machine import machine_facts
from bench.measure import Measurement, best_of
from tierckpt import Failures, Writes
from tierckpt.save.staging import HostStager

SCHEMA = "tierckpt-bench-gpu/1"
SECTIONS = ("d2h", "blocking", "fsdp_resume")
D2H_TARGET = 0.8
"""HostStager's staging rate over a single pinned cudaMemcpy of the same bytes."""
LAYERS = 4
_REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True)
class GpuConfig:
    """One run: device, state size (bytes), repeats, sections, where results and checkpoints go."""

    device: str
    state_bytes: int
    repeats: int
    sections: tuple[str, ...]
    out_dir: Path
    target_dir: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


# --- the model both sections use -------------------------------------------------------------

class MlpBlock(nn.Module):
    """Pre-norm residual MLP block (a transformer block's parameter shapes without attention)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


def model_dim(state_bytes: int, layers: int = LAYERS) -> int:
    """Width (a multiple of 64) whose ``layers`` blocks hold about ``state_bytes`` of fp32
    parameters + AdamW's two moments: 12 bytes per parameter, ~8·dim² per block."""
    return max(64, round(math.sqrt(state_bytes / (12 * 8 * layers)) / 64) * 64)


def build_model(state_bytes: int, device: torch.device) -> nn.Sequential:
    """``LAYERS`` blocks of width :func:`model_dim`, built (and initialised) on ``device``."""
    torch.manual_seed(0)
    with device:
        return nn.Sequential(*(MlpBlock(model_dim(state_bytes)) for _ in range(LAYERS)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- d2h ---------------------------------------------------------------------------------------

def _device_tree(state_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's parameters and two moment-shaped tensors per parameter, random, on device."""
    shapes = [(n, p.shape) for n, p in build_model(state_bytes, torch.device("meta"))
              .named_parameters()]
    g = torch.Generator(device=device).manual_seed(1)
    return {f"{n}.{k}": torch.rand(s, generator=g, device=device)
            for n, s in shapes for k in ("param", "exp_avg", "exp_avg_sq")}


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _plain_copy(nbytes: int, device: torch.device, repeats: int) -> list[float]:
    """The ceiling: one device tensor into one preallocated (pinned on CUDA) host tensor."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return [_timed(lambda: dst.copy_(src, non_blocking=True), device)
            for _ in range(repeats + 1)][1:]  # round 0 warms up


def _pinned_bytes(device: torch.device) -> int | None:
    """Bytes the pinned (host) allocator holds: rounded blocks, cached ones included."""
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def _ordered(stager: HostStager, tree: dict[str, torch.Tensor], overlap: bool) -> bool:
    """Change every source in place (kernels queued, not waited for), stage at once, and
    check the host copy: it must hold the changed values, so staging waited for that work."""
    for t in tree.values():
        t.add_(1.0)
    staged = stager.stage(tree, defer=(lambda path, t: True) if overlap else None)
    staged.ready.result(timeout=600)
    return all(torch.equal(staged.tree[k], t.cpu()) for k, t in tree.items())


def measure_d2h(cfg: GpuConfig, device: torch.device) -> dict[str, Any]:
    """HostStager.stage (sync and overlapped) against one plain copy of the same bytes."""
    tree = _device_tree(cfg.state_bytes, device)
    nbytes = sum(t.numel() * t.element_size() for t in tree.values())
    pinned_before = _pinned_bytes(device)
    stager = HostStager()
    try:
        sync_runs = [_timed(lambda: stager.stage(tree), device)
                     for _ in range(cfg.repeats + 1)][1:]  # round 0 allocates the buffers
        allocated, pinned = stager.allocations, _pinned_bytes(device)
        blocked, landed, busy = [], [], []
        for _ in range(cfg.repeats):
            _sync(device)
            start, cpu = time.perf_counter(), time.process_time()
            staged = stager.stage(tree, defer=lambda path, t: True)
            blocked.append(time.perf_counter() - start)
            staged.ready.result(timeout=600)
            landed.append(time.perf_counter() - start)
            busy.append((time.process_time() - cpu) / landed[-1])
        ordered = {"sync": _ordered(stager, tree, False), "overlap": _ordered(stager, tree, True)}
        steady = stager.allocations == allocated
    finally:
        stager.close()
    plain = _plain_copy(nbytes, device, cfg.repeats)
    plain_m, sync_m = best_of(plain, nbytes), best_of(sync_runs, nbytes)
    ratio = sync_m.gbps / plain_m.gbps if plain_m.gbps else None
    return {
        "bytes": nbytes, "tensors": len(tree),
        "plain": _m(plain_m, "one copy_(non_blocking) into one pinned tensor + synchronize"
                    if cfg.cuda else "one copy_ into one preallocated tensor (CPU stand-in)"),
        "stage_sync": _m(sync_m, "HostStager.stage(sd), reused buffers"),
        "ratio": ratio, "target": D2H_TARGET,
        "met": (ratio >= D2H_TARGET) if cfg.cuda and ratio is not None else None,
        "overlap_blocked": _m(best_of(blocked, nbytes), "stage(sd, defer=all) returned"),
        "overlap_landed": _m(best_of(landed, nbytes), "stage(sd, defer=all) → ready resolved"),
        # process CPU seconds per wall second from stage() to ready; on CUDA the copies are
        # DMA, so ~1.0 means a thread spun while waiting (on CPU the copy threads do the work)
        "overlap_cpu_per_wall": busy,
        "verified": all(ordered.values()), "ordered": ordered, "allocations_steady": steady,
        "pinned_reserved_bytes": None if pinned is None or pinned_before is None
        else pinned - pinned_before,
    }


def _m(m: Measurement, note: str) -> dict[str, Any]:
    return Measurement(m.seconds, m.bytes, m.runs, note, m.extra).to_json()


# --- blocking ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _process_group(device: torch.device) -> Iterator[None]:
    """A one-process group on loopback: NCCL for CUDA tensors plus gloo for DCP's CPU side."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    tierckpt.init_distributed("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.update(saved)


class _StepClock:
    """Two optimizer step pre-hooks around whatever hooks were registered in between (the
    manager's, which waits for overlapped staging): ``waited()`` is the time spent there in
    the last ``step()``. Hooks run in registration order."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self._a, self._b = opt, 0.0, 0.0
        self._outer = opt.register_step_pre_hook(self._mark_a)
        self._inner: Any = None

    def _mark_a(self, *_: Any) -> None:
        self._a = time.perf_counter()

    def _mark_b(self, *_: Any) -> None:
        self._b = time.perf_counter()

    def enclose(self) -> None:
        """(Re-)register the inner hook, so that it runs after every hook registered so far
        (call it after the manager's first save registered its hook)."""
        if self._inner is not None:
            self._inner.remove()
        self._inner = self.opt.register_step_pre_hook(self._mark_b)

    def waited(self) -> float:
        return max(0.0, self._b - self._a)


@dataclass
class _Trainer:
    """The model, its optimizer and one fixed batch; ``step`` runs forward, backward, an
    optional wait, ``optimizer.step()``, and synchronizes."""

    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    clock: _StepClock

    def step(self, before_step: Callable[[], None] = lambda: None) -> float:
        """Forward, backward, ``before_step()`` (timed: returned), step, synchronize."""
        loss = self.model(self.x).square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t = time.perf_counter()
        before_step()
        waited = time.perf_counter() - t
        self.opt.step()
        _sync(self.x.device)
        return waited


@dataclass
class _Round:
    """Seconds of one save round: the call, the wait before the step, the iteration with the
    save, the same iteration without one just before (``base``), save → committed, and
    tierckpt's own blocked time (None for DCP)."""

    call: float
    wait: float
    total: float
    base: float
    durable: float
    gate: float | None = None


def _round(tr: _Trainer, save: Callable[[], Any], wait_staged: Callable[[Any], None],
           wait_durable: Callable[[Any], float | None]) -> _Round:
    base = _timed(tr.step, tr.x.device)  # paired: a loaded machine drifts between rounds
    start = time.perf_counter()
    pending = save()
    call = time.perf_counter() - start
    waited = tr.step(lambda: wait_staged(pending))
    total = time.perf_counter() - start
    gate = wait_durable(pending)
    return _Round(call, waited + tr.clock.waited(), total, base, time.perf_counter() - start,
                  gate)


def _tierckpt_rounds(tr: _Trainer, root: Path, mode: str, repeats: int) -> list[_Round]:
    state = tierckpt.TrainState(model=tr.model, optimizer=tr.opt)
    with tierckpt.CheckpointManager(tier1=root / f"tierckpt-{mode}", keep_last=1,
                                    writes=Writes(staging=mode),
                                    failures=Failures(collective_timeout_s=300)) as ckpt:

        def save(step: int) -> Any:
            return ckpt.save(step, state)

        def durable(h: Any) -> float:
            h.wait(timeout=600)
            return float(h.staged.result())

        save(0).wait(timeout=600)  # allocates the host buffers; registers the step hook
        tr.step()
        tr.clock.enclose()
        return [_round(tr, functools.partial(save, step), lambda h: None, durable)
                for step in range(1, repeats + 1)]


def _dcp_stager(kind: str, cuda: bool) -> DefaultStager | None:
    """None: DCP's own default (a fresh CPU copy per save, staged before it returns)."""
    if kind == "default":
        return None
    # On CPU: no pinning and no non-blocking copies (both need an accelerator).
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                        use_async_staging=kind == "stager_async",
                                        use_non_blocking_copy=cuda))


def _dcp_rounds(tr: _Trainer, root: Path, kind: str, cuda: bool, repeats: int) -> list[_Round]:
    stager = _dcp_stager(kind, cuda)
    paths = iter(root / f"dcp-{kind}-{i}" for i in range(repeats + 1))

    def save() -> Any:
        msd, osd = get_state_dict(tr.model, tr.opt)
        return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=next(paths),
                              async_stager=stager)

    def staged(r: Any) -> None:
        if isinstance(r, AsyncSaveResponse):
            r.staging_completion.result(timeout=600)

    def durable(r: Any) -> None:
        (r.upload_completion if isinstance(r, AsyncSaveResponse) else r).result(timeout=600)
        for p in root.glob(f"dcp-{kind}-*"):
            shutil.rmtree(p, ignore_errors=True)

    try:
        rounds = [_round(tr, save, staged, durable) for _ in range(repeats + 1)]
    finally:
        if stager is not None:
            stager.close()
    return rounds[1:]  # round 0 starts DCP's threads (and a reused stager allocates)


VARIANTS = ("tierckpt_sync", "tierckpt_overlap", "dcp_default", "dcp_stager",
            "dcp_stager_async")


def variant_note(name: str, cuda: bool) -> str:
    """What a ``blocking`` variant is, as the table says it (pinning only exists on CUDA)."""
    opts = "pinned, shared" if cuda else "shared, no pinning"
    return {
        "tierckpt_sync": "tierckpt save(), staging='sync'",
        "tierckpt_overlap": "tierckpt save(), staging='overlap' (+ wait in optimizer.step)",
        "dcp_default": "dcp.async_save, default stager (fresh CPU copy per save)",
        "dcp_stager": f"dcp.async_save, reused DefaultStager({opts}), sync staging",
        "dcp_stager_async": f"dcp.async_save, reused DefaultStager({opts}, async staging) "
                            "(+ wait for staging_completion before step)",
    }[name]


def measure_blocking(cfg: GpuConfig, device: torch.device, work: Path) -> dict[str, Any]:
    """C of tierckpt's save() (sync, overlap) and of dcp.async_save (three stagers)."""
    with _process_group(device):
        model = build_model(cfg.state_bytes, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        dim = model_dim(cfg.state_bytes)
        x = torch.randn(4096 if cfg.cuda else 64, dim, device=device)
        tr = _Trainer(model, opt, x, _StepClock(opt))
        for _ in range(2):  # creates AdamW's state; warms kernels and the allocator
            tr.step()
        base = [_timed(tr.step, device) for _ in range(max(3, cfg.repeats))]
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(get_state_dict(model, opt)))
        variants: dict[str, Any] = {}
        for name in VARIANTS:
            note = variant_note(name, cfg.cuda)
            try:
                if name.startswith("tierckpt_"):
                    rounds = _tierckpt_rounds(tr, work, name.split("_", 1)[1], cfg.repeats)
                else:
                    rounds = _dcp_rounds(tr, work, name.split("_", 1)[1], cfg.cuda, cfg.repeats)
                variants[name] = _summarize(rounds, nbytes, note)
            except Exception as e:  # one stager failing (e.g. /dev/shm too small) is a row
                variants[name] = {"error": f"{type(e).__name__}: {e}", "note": note}
            tr.clock.enclose()
    _compare(variants)
    return {"bytes": nbytes, "model": {"dim": dim, "layers": LAYERS, "batch": x.shape[0],
                                       "params": sum(p.numel() for p in model.parameters())},
            "step_seconds": best_of(base, 0).to_json(), "variants": variants}


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _tensors(v)


def _summarize(rounds: list[_Round], nbytes: int, note: str) -> dict[str, Any]:
    best = min(rounds, key=lambda r: r.call + r.wait)
    lost = [r.total - r.base for r in rounds]
    out = {"blocked": best_of([r.call + r.wait for r in rounds], nbytes, note).to_json(),
           "call": [r.call for r in rounds], "wait": [r.wait for r in rounds], "lost": lost,
           "base": [r.base for r in rounds], "durable": [r.durable for r in rounds],
           "best_lost": min(lost), "best_call": best.call, "best_wait": best.wait,
           "note": note}
    if best.gate is not None:
        out["gate_blocked"] = [r.gate for r in rounds]  # tierckpt's own save_staged seconds
    return out


def _compare(variants: dict[str, Any]) -> None:
    """Add blocked-time ratios against DCP's default and against the best DCP variant."""
    dcp_s = {k: v["blocked"]["seconds"] for k, v in variants.items()
             if k.startswith("dcp_") and "blocked" in v}
    for v in variants.values():
        if "blocked" not in v:
            continue
        s = v["blocked"]["seconds"]
        v["vs_dcp_default"] = s / dcp_s["dcp_default"] if dcp_s.get("dcp_default") else None
        v["vs_best_dcp"] = s / min(dcp_s.values()) if dcp_s and min(dcp_s.values()) else None


# --- the run -----------------------------------------------------------------------------------

CPU_STAND_INS = {
    "d2h": "CPU tensors staged into unpinned buffers by HostStager's copy threads, against one "
           "copy_ of the same bytes into one preallocated tensor; no CUDA stream, no pinning",
    "blocking": "the model on CPU in a gloo group; DCP's DefaultStager without pinned memory "
                "or non-blocking copies (both need an accelerator)",
    "fsdp_resume": "FSDP2 on gloo + CPU instead of NCCL; the losses must be bit-identical",
}


def device_facts(cfg: GpuConfig) -> dict[str, Any]:
    """The accelerator (when CUDA is used), torch's build and the host."""
    out: dict[str, Any] = {"requested": cfg.device, "cuda_available": torch.cuda.is_available(),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if cfg.cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_bytes=props.total_memory, count=torch.cuda.device_count())
        with contextlib.suppress(Exception):  # a build without NCCL
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    cfg.target_dir.mkdir(parents=True, exist_ok=True)
    host = machine_facts(cfg.target_dir)
    out.update({k: host[k] for k in ("cores", "cores_usable", "cpu_model", "mem_total_bytes",
                                     "kernel", "python", "target_fs", "loadavg_start")})
    return out


def run(cfg: GpuConfig) -> dict[str, Any]:
    """Every section of ``cfg``; results are written after each (see module docstring)."""
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    t0 = time.perf_counter()
    device = torch.device("cuda", 0) if cfg.cuda else torch.device("cpu")
    if cfg.cuda:
        torch.cuda.set_device(device)
    work = cfg.target_dir / f"gpu-{stamp}"
    r: dict[str, Any] = {
        "schema": SCHEMA, "started": stamp, "finished": None, "wall_seconds": None,
        "errors": [],
        "config": {"device": cfg.device, "mib": cfg.state_bytes >> 20,
                   "state_bytes": cfg.state_bytes, "repeats": cfg.repeats,
                   "sections": list(cfg.sections), "target_dir": str(cfg.target_dir)},
        "device": device_facts(cfg),
        "cpu_mode": None if cfg.cuda else {k: CPU_STAND_INS[k] for k in cfg.sections},
        "sections": {},
    }
    measure: dict[str, Callable[[], dict[str, Any]]] = {
        "d2h": lambda: measure_d2h(cfg, device),
        "blocking": lambda: measure_blocking(cfg, device, work),
        "fsdp_resume": lambda: measure_fsdp_resume(cfg.device, work),
    }
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name in cfg.sections:
            _say(f"{name} ...")
            start = time.perf_counter()
            try:
                r["sections"][name] = {**measure[name](), "section_seconds":
                                       time.perf_counter() - start}
            except BaseException as e:  # SystemExit from SIGTERM too: record, then stop
                r["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
                r["errors"].append({"section": name, "error": traceback.format_exc()})
                if not isinstance(e, Exception):
                    write_results(r, cfg.out_dir, stamp)
                    raise
            _say(f"{name} done in {time.perf_counter() - start:.1f} s")
            r["wall_seconds"] = time.perf_counter() - t0
            write_results(r, cfg.out_dir, stamp)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r["finished"] = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    r["wall_seconds"] = time.perf_counter() - t0
    write_results(r, cfg.out_dir, stamp)
    return r


def _say(msg: str) -> None:
    print(f"[bench.gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- CLI ---------------------------------------------------------------------------------------

def _parse(argv: list[str] | None) -> GpuConfig:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mib", type=int, default=2048,
                   help="state size in MiB (d2h bytes; model parameters + AdamW state)")
    p.add_argument("--out", type=Path, default=_REPO / "bench" / "results",
                   help="directory for <stamp>-gpu.json and .md")
    p.add_argument("--target", type=Path, default=_REPO / "bench" / "out",
                   help="directory for the checkpoints written (removed afterwards)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    a = p.parse_args(argv)
    sections = tuple(x.strip() for x in a.sections.split(",") if x.strip())
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown or not sections:
        p.error(f"--sections: {', '.join(unknown) or 'none given'}: choose from "
                f"{', '.join(SECTIONS)}")
    if a.mib < 1 or a.repeats < 1:
        p.error("--mib and --repeats must be >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA device "
                f"(torch.version.cuda={torch.version.cuda}); use --device cpu for the stand-ins")
    return GpuConfig(device=a.device, state_bytes=a.mib << 20, repeats=a.repeats,
                     sections=sections, out_dir=a.out, target_dir=a.target)


def main(argv: list[str] | None = None) -> int:
    cfg = _parse(argv)
    # `timeout` sends SIGTERM: unwind, so the torchrun jobs are killed and the partial
    # results written (the default action would end the process on the spot)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    r = run(cfg)
    resume = r["sections"].get("fsdp_resume", {})
    print(render_markdown(r))
    return 1 if r["errors"] or resume.get("ok") is False else 0


if __name__ == "__main__":
    sys.exit(main())
