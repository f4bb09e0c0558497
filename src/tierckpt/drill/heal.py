"""The heal drill: one job under ``tierckpt run --heal``, a seeded series of rank deaths,
and the proof that every one ended in a heal (or, when it must, a full restart) that lost
nothing and changed no loss.

1. **reference** — the command uninterrupted under torchrun: the losses to match.
2. **heal** — the same command under ``tierckpt run --nproc-per-node N`` (two pre-warmed
   spares). One fault after another, each once a seeded step is logged and the previous
   one is over:

   ============  ===============================================================  ========
   fault         what is killed (SIGKILL)                                         expected
   ============  ===============================================================  ========
   mid_step      a seeded rank, at once (it is inside a step)                     heal
   two_at_once   two seeded ranks within a millisecond                            heal
   mid_save      a seeded rank as soon as its next save is staged (the write is   heal
                 in the background)
   replacement   a seeded rank, then its replacement while it loads its state     restart
   mid_heal      a seeded rank, then a survivor once its heal has begun           restart
   ============  ===============================================================  ========

Verdicts: ``continuity`` (every step logged, every logged loss equal to the reference's, bit
for bit on CPU), ``outcomes`` (each fault ended as expected: ``heal_done`` on every survivor,
or the launcher's full restart), ``finished`` (the job exited 0). Measured per heal from the
events: R (the kill → the first step completed after it), and its parts. :func:`run_heal`
returns the report document and never raises for a failed verdict.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt.drill.launch import JobSpec, heal_argv, training_argv
from tierckpt.drill.reportfile import write_report_files
from tierckpt.drill.runs import RunResult, run_job
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.runtime import events as ev

__all__ = ["HEAL_FAULTS", "HEAL_STAGES", "HealDrillConfig", "judge", "run_heal"]

HEAL_STAGES = ("reference", "heal")
HEAL_FAULTS = {"mid_step": "heal", "two_at_once": "heal", "mid_save": "heal",
               "replacement": "restart", "mid_heal": "restart"}
"""Each fault and how it must end."""
_POLL_S = 0.01

Progress = Callable[[str, str, str], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealDrillConfig:
    """What to drill: ``command`` (the contract of :mod:`tierckpt.drill.launch`; its loop
    heals as examples/train.py's does) with ``nproc`` ranks on one node, ``steps`` steps,
    the ``faults`` in order (names of :data:`HEAL_FAULTS`), ``seed`` for the steps and ranks,
    ``job_timeout_s`` per run."""

    command: tuple[str, ...]
    out: Path = Path("drill-out")
    nproc: int = 3
    steps: int = 120
    faults: tuple[str, ...] = tuple(HEAL_FAULTS)
    seed: int = 0
    job_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("give the training command after --, e.g. "
                              "tierckpt drill --heal -- python examples/train.py")
        unknown = [f for f in self.faults if f not in HEAL_FAULTS]
        if unknown or not self.faults:
            raise ConfigError(f"heal faults {unknown or '(none)'}: choose from "
                              f"{', '.join(HEAL_FAULTS)}")
        if self.nproc < 3:
            raise ConfigError(f"the heal drill needs --nproc >= 3 (two ranks die at once and "
                              f"one must survive), got {self.nproc}")
        if self.steps < 10 * (len(self.faults) + 1):
            raise ConfigError(f"--steps {self.steps} is too few for {len(self.faults)} "
                              f"faults: give at least {10 * (len(self.faults) + 1)}")


def run_heal(cfg: HealDrillConfig, progress: Progress = lambda *a: None) -> dict[str, Any]:
    """Run the drill; the report document (also written to ``<out>/heal-report.json`` and
    ``.md``)."""
    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress("reference", "running", "")
    ref = run_job(JobSpec(name="heal-reference", command=cfg.command,
                          roots=(out / "heal-reference" / "t1",),
                          losses=out / "heal-reference" / "losses.jsonl", steps=cfg.steps,
                          nproc=cfg.nproc), timeout_s=cfg.job_timeout_s)
    progress("reference", "done" if ref.rc == 0 else "failed", f"exit {ref.rc}")
    progress("heal", "running", "")
    run = _HealRun(cfg, out / "heal-run")
    faults = run.drive() if ref.rc == 0 else []
    progress("heal", "done" if run.rc == 0 else "failed", f"exit {run.rc}")
    doc = _report(cfg, ref, run, faults)
    files = write_report_files(doc, out, "heal-report", _markdown, record=False)
    doc["files"] = {"report": files["md"]}
    progress("report", "done", files["md"])
    return doc


class _HealRun:
    """The heal job and its faults."""

    def __init__(self, cfg: HealDrillConfig, d: Path) -> None:
        self.cfg, self.root, self.losses = cfg, d / "t1", d / "losses.jsonl"
        self.log = d / "heal-run.log"
        self.rc: int | None = None
        self.proc: subprocess.Popen[bytes]
        self.root.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(cfg.seed)

    def drive(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        argv = heal_argv(training_argv(cfg.command, tier1=self.root, losses=self.losses,
                                       steps=cfg.steps),
                         nproc=cfg.nproc, max_restarts=len(cfg.faults))
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        span = cfg.steps // (len(cfg.faults) + 1)
        records = []
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env)
            try:
                for i, kind in enumerate(cfg.faults):
                    at = span * (i + 1) + self.rng.randrange(0, max(1, span // 2))
                    records.append(self._fault(kind, at))
                self.rc = self.proc.wait(cfg.job_timeout_s)
            except (TimeoutError, subprocess.TimeoutExpired) as e:
                self.proc.kill()
                self.rc = self.proc.wait()
                records.append({"kind": "error", "error": str(e)})
        return records

    # -- eyes -------------------------------------------------------------------------------
    def _events(self, kind: str | None = None) -> list[dict[str, Any]]:
        p = self.root / layout.EVENTS
        recs = ev.read_events(p) if p.is_file() else []
        return [e for e in recs if kind is None or e["event"] == kind]

    def _logged(self) -> int:
        if not self.losses.is_file():
            return 0
        return len([x for x in self.losses.read_text().splitlines() if x.strip()])

    def _pid(self, rank: int) -> int:
        return int([e for e in self._events(ev.PROCESS_START) if e["rank"] == rank][-1]["pid"])

    def _wait(self, what: str, cond: Callable[[], bool]) -> None:
        end = time.monotonic() + self.cfg.job_timeout_s
        while not cond():
            if self.proc.poll() is not None:
                raise TimeoutError(f"the job ended before {what}")
            if time.monotonic() > end:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(_POLL_S)

    # -- faults -----------------------------------------------------------------------------
    def _fault(self, kind: str, at: int) -> dict[str, Any]:
        n = self.cfg.nproc
        self._wait(f"step {at}", lambda: self._logged() > at)
        heals = len(self._events(ev.HEAL_DONE))
        starts = len(self._events(ev.PROCESS_START))
        victims = self.rng.sample(range(n), 2 if kind == "two_at_once" else 1)
        if kind == "mid_save":
            staged = {e["step"] for e in self._events(ev.SAVE_STAGED)}
            self._wait("the next save", lambda: any(
                e["step"] not in staged and e["rank"] == victims[0]
                for e in self._events(ev.SAVE_STAGED)))
        t_kill = time.time()
        pids = [self._pid(r) for r in victims]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        if kind == "replacement":
            self._wait("the replacement", lambda: len(self._events(ev.PROCESS_START)) > starts)
            os.kill(self._pid(victims[0]), signal.SIGKILL)
        elif kind == "mid_heal":  # once this survivor began the heal (a survivor that dies
            survivor = next(r for r in range(n) if r not in victims)  # before it is replaced
            begun = len([e for e in self._events(ev.HEAL_BEGIN) if e["rank"] == survivor])
            self._wait("a heal", lambda: len(  # in the same heal) and its replacement started
                [e for e in self._events(ev.HEAL_BEGIN) if e["rank"] == survivor]) > begun
                and len(self._events(ev.PROCESS_START)) > starts)
            victims.append(survivor)
            os.kill(self._pid(survivor), signal.SIGKILL)
        # over: a heal done on every survivor, or every rank started again (a full restart)
        self._wait(f"the end of {kind}", lambda: self._logged() > at and (
            len(self._events(ev.HEAL_DONE)) >= heals + n - len(set(victims))
            or len(self._events(ev.PROCESS_START)) >= starts + n))
        self._wait("a step after it", lambda: any(
            float(json.loads(x)["t"]) > t_kill for x in self.losses.read_text().splitlines()
            if x.strip()))
        return {"kind": kind, "at_step": at, "ranks": victims, "t_kill": t_kill}


def _report(cfg: HealDrillConfig, ref: RunResult, run: _HealRun,
            faults: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [json.loads(x) for x in run.losses.read_text().splitlines() if x.strip()] \
        if run.losses.is_file() else []
    per_fault, verdicts = judge(ref, rows, run._events(), faults, steps=cfg.steps,
                                world=cfg.nproc, expected=HEAL_FAULTS,
                                planned=len(cfg.faults), rc=run.rc)
    return {"drill": "heal", "config": {**dataclasses.asdict(cfg), "out": str(cfg.out)},
            "faults": per_fault, "verdicts": verdicts,
            "ok": all(v["ok"] for v in verdicts.values())}


def judge(ref: RunResult, rows: list[dict[str, Any]], events: list[dict[str, Any]],
          faults: list[dict[str, Any]], *, steps: int, world: int,
          expected: dict[str, str], planned: int, rc: int | None
          ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """A heal drill's verdicts (this one's and the node drill's): each fault's outcome in
    the events between its kill and the next (``restart`` when all ``world`` ranks
    started again, ``heal`` when a ``heal_done`` came, else ``none``) against
    ``expected``, with R (the kill → the next loss row), the heal's seconds and the
    restored step; and ``continuity``, ``outcomes`` (``planned`` faults, each as
    expected) and ``finished`` (``rc`` 0)."""
    want = {r["step"]: r.get("loss_hex", r["loss"]) for r in ref.rows}
    wrong = [r["step"] for r in rows if r.get("loss_hex", r["loss"]) != want.get(r["step"])]
    covered = sorted({r["step"] for r in rows}) == list(range(steps))
    per_fault = []
    for i, f in enumerate(faults):
        if f["kind"] == "error":
            per_fault.append({**f, "outcome": "error", "ok": False})
            continue
        t0 = f["t_kill"]
        t1 = faults[i + 1]["t_kill"] if i + 1 < len(faults) and "t_kill" in faults[i + 1] \
            else float("inf")
        window = [e for e in events if t0 <= float(e["t"]) < t1]
        healed = [e for e in window if e["event"] == ev.HEAL_DONE]
        restarted = {e["rank"] for e in window if e["event"] == ev.PROCESS_START}
        outcome = "restart" if len(restarted) == world else "heal" if healed else "none"
        after = [float(r["t"]) for r in rows if float(r["t"]) > t0]
        per_fault.append({
            **f, "outcome": outcome, "ok": outcome == expected[f["kind"]],
            "R_s": (after[0] - t0) if after else None,
            "heal_s": max((e["seconds"] for e in healed), default=None),
            "restored_step": healed[0]["step"] if healed else None})
    verdicts = {
        "continuity": {"ok": covered and not wrong and ref.rc == 0,
                       "detail": f"{len(rows)} steps logged, {len(wrong)} differ from the "
                                 f"reference" + ("" if covered else "; steps missing")},
        "outcomes": {"ok": len(per_fault) == planned and all(
            p["ok"] for p in per_fault), "detail": ", ".join(
            f"{p['kind']}: {p['outcome']}" for p in per_fault)},
        "finished": {"ok": rc == 0, "detail": f"exit {rc}"},
    }
    return per_fault, verdicts


def _markdown(doc: dict[str, Any]) -> str:
    lines = ["# Heal drill", "", "| fault | at step | ranks | outcome | R (s) | heal (s) | "
             "restored step | ok |", "|---|---|---|---|---|---|---|---|"]
    for f in doc["faults"]:
        r = f.get("R_s")
        h = f.get("heal_s")
        lines.append(f"| {f['kind']} | {f.get('at_step', '—')} | {f.get('ranks', '—')} | "
                     f"{f['outcome']} | {'—' if r is None else f'{r:.2f}'} | "
                     f"{'—' if h is None else f'{h:.2f}'} | {f.get('restored_step', '—')} | "
                     f"{'yes' if f['ok'] else 'NO'} |")
    lines += ["", "| verdict | ok | detail |", "|---|---|---|"]
    lines += [f"| {k} | {'yes' if v['ok'] else 'NO'} | {v['detail']} |"
              for k, v in doc["verdicts"].items()]
    return "\n".join(lines) + "\n"
