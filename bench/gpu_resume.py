"""The ``fsdp_resume`` section of ``bench.gpu``: a killed-and-resumed FSDP2 run against an
uninterrupted one.

Two torchrun launches of ``bench.gpu_job`` (world 1: NCCL allows one rank per GPU) start
together, each in its own directory under ``work``: the reference runs every step; the
other SIGKILLs itself after step ``_JOB["kill_at"]`` once its newest save committed, and
torchrun (``--max-restarts=1``) restarts it: it restores and runs to the end. Their loss rows
are compared by ``tierckpt.drill.verdicts.continuity``: bit for bit on CPU, within
``CUDA_RESUME_RTOL`` (relative) on CUDA. Neither launch outlives :func:`measure_fsdp_resume`,
whether it returns or raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.drill.verdicts import continuity

CUDA_RESUME_RTOL = 1e-5
"""Relative loss tolerance of the CUDA resume: kernels are not bit-reproducible in general,
but with deterministic algorithms on one GPU a correct restore stays far inside it (a wrong
or torn state moves the loss by 1e-3 or more). Tighter than the drills' ``GPU_RTOL``."""
_REPO = Path(__file__).resolve().parent.parent
_JOB = {"steps": 10, "save_every": 3, "kill_at": 6}  # saves after 2, 5, 8; resume from 5


@dataclass
class _Job:
    """One torchrun launch of ``bench.gpu_job`` writing into ``run``."""

    proc: subprocess.Popen[bytes]
    run: Path

    @classmethod
    def launch(cls, device: str, run: Path, *, kill: bool) -> _Job:
        run.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=1", f"--max-restarts={1 if kill else 0}",
               "--monitor-interval=0.2", "-m", "bench.gpu_job", "--device", device,
               "--tier1", str(run / "tier1"), "--losses", str(run / "losses.jsonl"),
               "--meta", str(run / "meta.jsonl"), "--steps", str(_JOB["steps"]),
               "--save-every", str(_JOB["save_every"])]
        if kill:
            cmd += ["--kill-at", str(_JOB["kill_at"])]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
            filter(None, [str(_REPO), os.environ.get("PYTHONPATH")])))
        if device != "cuda":
            env["OMP_NUM_THREADS"] = "1"  # two CPU jobs share the cores
        with open(run / "torchrun.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return cls(proc, run)

    def kill(self) -> None:
        """SIGKILL the launch's session (torchrun and its worker); a no-op once it ended."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def rows(self, timeout: float) -> list[dict[str, Any]]:
        """Wait for the job; its loss rows. RuntimeError with the log's tail if it failed."""
        try:
            rc: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        if rc != 0:
            tail = (self.run / "torchrun.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{self.run.name}: torchrun exited {rc} (None: timed out "
                               f"after {timeout:.0f} s)\n{tail}")
        return _jsonl(self.run / "losses.jsonl")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure_fsdp_resume(device: str, work: Path) -> dict[str, Any]:
    """Killed-and-resumed FSDP2 run (``device``: ``cuda`` or ``cpu``) against an
    uninterrupted one, launched together under ``work``; the section's JSON."""
    start = time.perf_counter()
    ref_dir, run_dir = work / "fsdp-reference", work / "fsdp-killed"
    jobs = [_Job.launch(device, ref_dir, kill=False), _Job.launch(device, run_dir, kill=True)]
    try:
        ref, rows = jobs[0].rows(300), jobs[1].rows(300)
    finally:
        for job in jobs:  # after a failure of the first, do not leave the second running
            job.kill()
    meta = _jsonl(run_dir / "meta.jsonl")
    restored = next((m["restored_step"] for m in meta if m["restored_step"] is not None), None)
    rtol = CUDA_RESUME_RTOL if device == "cuda" else 0.0
    verdict = continuity(ref, rows, rtol=rtol, resumed_from=restored)
    by_step = {r["step"]: r for r in ref}
    rel = [abs(r["loss"] - by_step[r["step"]]["loss"]) / abs(by_step[r["step"]]["loss"])
           for r in rows if r["step"] in by_step and by_step[r["step"]]["loss"]]
    return {"ok": verdict.ok, "bit_identical": all(
                r["loss_hex"] == by_step[r["step"]]["loss_hex"] for r in rows
                if r["step"] in by_step),
            "tolerance": {"mode": verdict.mode, "rtol": rtol}, "compared": verdict.compared,
            "resumed_rows": verdict.resumed_rows, "restored_step": restored,
            "killed_after": _JOB["kill_at"], "steps": _JOB["steps"],
            "save_every": _JOB["save_every"], "max_abs_diff": verdict.max_abs_diff,
            "max_rel_diff": max(rel, default=0.0), "mismatches": verdict.mismatches,
            "missing": verdict.missing, "meta": meta, "seconds": time.perf_counter() - start}

