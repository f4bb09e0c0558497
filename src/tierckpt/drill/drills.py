"""The five drills, in order, against one training command; see docs/drills.md.

1. **reference** — an uninterrupted run (with tier 2): the losses to match, C and W.
2. **kill** — the same job under torchrun with one restart allowed; one rank is SIGKILLed
   from outside after a seeded random step that is not a save step; R and its parts.
3. **continuity** — the killed run's losses (before and after the resume) against the
   reference: bit for bit on CPU, ``GPU_RTOL`` on GPU.
4. **reshard** — a fresh root seeded with one of the reference's 2-rank checkpoints,
   restored at other world sizes (1 and 3) and trained on; samples neither repeated nor
   skipped.
5. **tier2** — the reference's uploads drained, every tier-1 root wiped, the job restored
   from tier 2 alone and trained a few more steps; timed.

:func:`run_drills` returns the report document (``tierckpt.drill.report``) and never raises
for a failed drill: failures are verdicts. ConfigError for bad configuration.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from typing import Any

from tierckpt.drill import verdicts as vd
from tierckpt.drill.job import DrillJob, check_steps
from tierckpt.drill.launch import JobSpec
from tierckpt.drill.report import build_report, write_report
from tierckpt.drill.runs import (
    RunResult,
    choose_mid_checkpoint,
    drain_and_wipe,
    restore_summary,
    run_job,
    seed_root,
)
from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.runtime import events as ev
from tierckpt.runtime import measure
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

__all__ = ["DRILLS", "DrillConfig", "Progress", "run_drills"]

DRILLS = ("reference", "kill", "continuity", "reshard", "tier2")
"""Drill names in the order they run (the report adds ``report``)."""

Progress = Callable[[str, str, str], None]
"""``progress(drill, state, detail)``; state is ``running``, ``passed``, ``failed`` or
``skipped``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrillConfig(DrillJob):
    """What to drill and where: the job (:class:`~tierckpt.drill.job.DrillJob`: ``command``,
    ``nproc`` ranks per node on ``nnodes`` simulated nodes, ``tier2``, ``rtol``; its
    ``seed`` picks the kill); ``steps`` per run; ``reshard_sizes`` the world sizes the
    reshard drill restores at; ``tier2_extra_steps`` trained after the tier-2-only restore;
    ``job_timeout_s`` bounds each job."""

    steps: int = 20
    reshard_sizes: tuple[int, ...] = (1, 3)
    tier2_extra_steps: int = 2
    job_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        super().__post_init__()
        v = self.tier2_extra_steps
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"--tier2-extra-steps must be an int >= 1, got {v!r}")
        check_steps(self.steps, " (a save, a kill and a resume need room)")
        if any(not isinstance(w, int) or w < 1 for w in self.reshard_sizes):
            raise ConfigError(f"reshard world sizes must be ints >= 1, got {self.reshard_sizes}")

    def spec(self, run: str, **kw: Any) -> JobSpec:
        nnodes = kw.pop("nnodes", self.nnodes)
        base: dict[str, Any] = dict(name=run, command=self.command, nproc=self.nproc,
                                    roots=self.roots(run, nnodes), steps=self.steps,
                                    losses=self.out / "runs" / run / "losses.jsonl")
        base.update(kw)
        return JobSpec(**base)


def _noop(drill: str, state: str, detail: str) -> None:
    pass


def run_drills(cfg: DrillConfig, progress: Progress = _noop) -> dict[str, Any]:
    """Run every drill (in a fresh ``<out>/runs``), write the report files into ``out``
    (``doc["files"]``) and return the report document."""
    doc = _run_all(cfg, progress)
    progress("report", "running", "")
    write_report(doc, cfg.out)
    progress("report", "passed" if doc["ok"] else "failed", doc["files"]["json"])
    return doc


def _fresh_out(job: DrillJob) -> str:
    """Before a drill's runs (resume and preemption drills): an empty ``<out>/runs``, the
    default tier 2 (``file://<out>/tier2``, the drill's own) started empty, and a tier 2
    that already holds checkpoints refused (ConfigError). Returns the tier-2 URL."""
    runs_dir = job.out / "runs"
    if runs_dir.exists():
        shutil.rmtree(runs_dir)
    tier2_dir = job.out / "tier2"
    if job.tier2 == f"file://{tier2_dir}":  # the default tier 2 is ours: start it empty
        if tier2_dir.exists():
            shutil.rmtree(tier2_dir)
        tier2_dir.mkdir(parents=True)  # a file:// tier 2 is never created by opening it
    assert job.tier2 is not None
    _require_empty_tier2(job.tier2)
    return job.tier2


def _run_all(cfg: DrillConfig, progress: Progress) -> dict[str, Any]:
    _fresh_out(cfg)
    t0 = time.time()
    results: dict[str, dict[str, Any]] = {}
    runs: list[RunResult] = []

    def step(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        progress(name, "running", "")
        try:
            res = fn()
        except CheckpointError as e:
            res = {"ok": False, "error": str(e)}
        results[name] = res
        progress(name, "passed" if res.get("ok") else "failed", res.get("summary", ""))
        return res

    step("reference", lambda: _reference(cfg, runs))
    ref = _named(runs, "reference")
    if ref is None or not results["reference"]["ok"]:
        for name in DRILLS[1:]:
            results[name] = {"ok": False, "error": "the reference run failed"}
            progress(name, "skipped", "the reference run failed")
        return build_report(cfg, results, runs, t0)
    step("kill", lambda: _kill(cfg, ref, runs))
    step("continuity", lambda: _continuity(cfg, ref, _named(runs, "kill")))
    step("reshard", lambda: _reshard(cfg, ref, runs))
    step("tier2", lambda: _tier2(cfg, ref, runs))
    return build_report(cfg, results, runs, t0)


def _require_empty_tier2(url: str) -> None:
    """The reference run must start from nothing: a checkpoint already on tier 2 would be
    restored by it (and picked by the tier-2 drill)."""
    try:
        with open_storage(url) as storage:
            steps = Tier2Catalog(storage).complete_steps()
    except (CheckpointError, OSError) as e:
        raise ConfigError(f"--tier2 {url}: cannot list it ({e})") from None
    if steps:
        raise ConfigError(f"--tier2 {url} already holds checkpoints (steps {steps[:5]}); give "
                          "an empty prefix, or leave --tier2 out for file://<out>/tier2")


def _named(runs: list[RunResult], name: str) -> RunResult | None:
    return next((r for r in runs if r.name == name), None)


def _failed(run: RunResult, what: str) -> dict[str, Any]:
    why = run.notes.get("kill_error") or f"exit status {run.rc}"
    return {"ok": False, "error": f"{what}: {why}", "log_tail": run.log_tail[-2000:]}


def _reference(cfg: DrillConfig, runs: list[RunResult]) -> dict[str, Any]:
    run = run_job(cfg.spec("reference", tier2=cfg.tier2), timeout_s=cfg.job_timeout_s)
    runs.append(run)
    if run.rc != 0:
        return _failed(run, "the reference run failed")
    m = measure.from_events(run.events)
    saves = sorted({int(e["step"]) for e in run.of(ev.SAVE_COMMITTED)})
    steps = sorted(vd.losses_by_step(run.rows))
    ok = steps == list(range(cfg.steps)) and bool(saves)
    return {"ok": ok, "save_steps": saves, "steps_logged": len(steps),
            "C_s": m.C.seconds if m.C else None, "W_s": m.W.seconds if m.W else None,
            "checkpoint_bytes": max((int(e.get("bytes", 0)) for e in
                                     run.of(ev.SAVE_COMMITTED)), default=0),
            "summary": f"{len(steps)} steps, saves at {saves}",
            **({} if ok else {"error": f"logged steps {steps[:5]}..., saves {saves}"})}


def _kill(cfg: DrillConfig, ref: RunResult, runs: list[RunResult]) -> dict[str, Any]:
    plan = vd.choose_kill(cfg.seed, steps=cfg.steps,
                          save_steps=[int(e["step"]) for e in ref.of(ev.SAVE_COMMITTED)],
                          world_size=cfg.world_size)
    run = run_job(cfg.spec("kill", max_restarts=1), timeout_s=cfg.job_timeout_s, kill=plan)
    runs.append(run)
    if run.rc != 0 or run.kill is None:
        return _failed(run, "the killed job did not finish after its restart")
    parts = vd.restart_parts(run.events, run.kill.t)
    if parts is None:
        return {"ok": False, "error": "no first_step after the restart", "kill":
                run.kill.as_dict()}
    restarts = [e for e in run.of(ev.PROCESS_START) if e.get("restart_count", 0) > 0]
    resumed = parts["resumed_from_step"] is not None
    writing = vd.unfinished_saves(run.events, run.kill.t)
    note = (f"; the save of step {', '.join(map(str, writing))} was still being written "
            "when the rank died, so the newest committed step was resumed" if writing else "")
    return {"ok": bool(restarts) and resumed, "plan": dataclasses.asdict(plan),
            "kill": run.kill.as_dict(), **parts, "restore": restore_summary(run),
            "lost_steps": run.kill.after_step - parts["resumed_from_step"] if resumed else None,
            "unfinished_saves": writing,
            "summary": f"rank {plan.rank} killed after step {run.kill.after_step}, resumed "
                       f"from {parts['resumed_from_step']} "
                       f"({(restore_summary(run) or {}).get('source')}), "
                       f"R = {parts['R_s']:.2f} s{note}",
            **({} if resumed else {"error": "the restart found no checkpoint to resume"})}


def _continuity(cfg: DrillConfig, ref: RunResult, run: RunResult | None) -> dict[str, Any]:
    kill = run.kill if run is not None else None
    if run is None or kill is None:
        return {"ok": False, "error": "the kill drill produced no resumed run"}
    rtol = cfg.rtol if cfg.rtol is not None else (vd.GPU_RTOL if _on_gpu(run) else 0.0)
    chosen = [e.get("step") for e in run.of(ev.CHECKPOINT_CHOSEN) if e["t"] >= kill.t]
    verdict = vd.continuity(ref.rows, run.rows, rtol=rtol,
                            resumed_from=chosen[0] if chosen else None)
    d = verdict.as_dict()
    d["summary"] = (f"{verdict.compared} losses {'bit-identical' if rtol == 0 else 'within rtol'}"
                    if verdict.ok else f"{len(verdict.mismatches)} mismatches, "
                    f"missing {verdict.missing[:5]}")
    return d


def _on_gpu(run: RunResult) -> bool:
    return any("nccl" in str(e.get("backend", "")) for e in run.of(ev.PG_READY))


def _reshard(cfg: DrillConfig, ref: RunResult, runs: list[RunResult]) -> dict[str, Any]:
    src = list(cfg.roots("reference"))
    step = choose_mid_checkpoint(src, steps=cfg.steps)
    out = []
    for w in cfg.reshard_sizes:
        name = f"reshard-w{w}"
        seed_root(src, step, cfg.roots(name, 1)[0])
        run = run_job(cfg.spec(name, nproc=w, nnodes=1), timeout_s=cfg.job_timeout_s)
        runs.append(run)
        out.append(_reshard_verdict(run, ref, step, w))
    ok = all(r["ok"] for r in out)
    return {"ok": ok, "checkpoint_step": step, "saved_world_size": cfg.world_size, "runs": out,
            "summary": ", ".join(f"{cfg.world_size}→{r['world_size']} "
                                 f"{'ok' if r['ok'] else 'FAILED'}" for r in out)}


def _reshard_verdict(run: RunResult, ref: RunResult, step: int, w: int) -> dict[str, Any]:
    restore = restore_summary(run)
    rows = sorted(vd.losses_by_step(run.rows).values(), key=lambda r: int(r["step"]))
    before = vd.losses_by_step(ref.rows).get(step)
    samples = vd.sample_continuity(ref.rows, rows, step)
    loaded = restore is not None and restore.get("step") == step
    loss_after = float(rows[0]["loss"]) if rows else None
    reference_after = _ref_loss(ref, step + 1)
    loss_ok = vd.reshard_loss_ok(loss_after, reference_after)
    ok = run.rc == 0 and loaded and loss_ok and samples.ok and \
        bool(rows) and int(rows[0]["step"]) == step + 1
    res: dict[str, Any] = {
        "world_size": w, "ok": ok, "loaded": loaded, "restore": restore,
        "loss_before": float(before["loss"]) if before else None,
        "loss_after": loss_after, "loss_reference_after": reference_after,
        "loss_ok": loss_ok, "steps_trained": len(rows), "samples": samples.as_dict()}
    if run.rc != 0:
        res.update(_failed(run, f"the world-size-{w} run failed"))
    return res


def _ref_loss(ref: RunResult, step: int) -> float | None:
    row = vd.losses_by_step(ref.rows).get(step)
    return float(row["loss"]) if row else None


def _tier2(cfg: DrillConfig, ref: RunResult, runs: list[RunResult]) -> dict[str, Any]:
    assert cfg.tier2 is not None
    roots = list(cfg.roots("reference"))
    remote = drain_and_wipe(roots, cfg.tier2, timeout_s=cfg.job_timeout_s)
    spec = cfg.spec("tier2", roots=tuple(roots), tier2=cfg.tier2,
                    steps=cfg.steps + cfg.tier2_extra_steps)
    run = run_job(spec, timeout_s=cfg.job_timeout_s)
    runs.append(run)
    if run.rc != 0:
        return {**_failed(run, "the tier-2 restore run failed"), "remote_steps": remote}
    restore = restore_summary(run)
    firsts = run.of(ev.FIRST_STEP)
    starts = run.of(ev.PROCESS_START)
    source = (restore or {}).get("source")
    t2_bytes = int(((restore or {}).get("bytes_by_source") or {}).get("tier2", 0))
    ok = bool(restore) and source == "tier2" and t2_bytes > 0 and \
        (restore or {}).get("step") == max(remote) and bool(firsts)
    restart_s = (max(float(e["t"]) for e in firsts) - min(float(e["t"]) for e in starts)
                 if firsts and starts else None)
    return {"ok": ok, "url": cfg.tier2, "remote_steps": remote, "restore": restore,
            "restore_s": (restore or {}).get("seconds"), "tier2_bytes": t2_bytes,
            "start_to_first_step_s": restart_s,
            "summary": f"restored step {(restore or {}).get('step')} from {source} in "
                       f"{(restore or {}).get('seconds') or float('nan'):.2f} s"}
