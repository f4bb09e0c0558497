"""Restart cost R by healing vs by a full torchrun restart, side by side in one run.

For each world size and state size, the same job (``bench/heal_job.py``: FSDP2, a save
every 5 steps) runs twice: under ``tierckpt run --heal`` (one pre-warmed spare) and under
``torchrun --max-restarts 1``. After step 12 (its newest save, step 9, committed) rank 1 is
SIGKILLed from outside. R is the kill → the first step completed after it (rank 0's step
log). Its parts, from the job's events:

- heal: ``detect`` (kill → the first survivor's ``heal_begin``), ``re-form`` (the failed
  generation let go, the launcher's next one awaited, the group formed, the manager
  reopened: ``heal_done``'s leave/wait/form/open), ``transfer`` (the state loaded in place,
  ``restore_s``), ``first step`` (state loaded → the step done);
- full restart: ``detect+start`` (kill → the new processes' group ready, ``pg_ready``:
  torchrun's detection, the stop of the others, interpreter, imports, rendezvous),
  ``transfer`` (→ ``restore_done``), ``first step``.

``ratio`` = R(heal) ÷ R(full), the target ≤ 0.25. R includes the first step, which does a
step's work; ``step_s`` is the job's steady step (the median before the kill) and
``downtime_s`` = R − ``step_s``, the time training made no progress, with its own ratio
(``downtime_ratio``): at 1 GiB a step takes seconds here, and it is in both Rs. A heal that
fell back to a full restart is reported as such (``outcome``, with the launcher's lines),
not as a heal.
``python -m bench.heal [--world 2,4] [--mib 256,1024] [--out bench/out/heal.json]``: a
Markdown table on stdout, JSON to --out; ``make bench BENCH_ARGS=--heal`` writes
``bench/results/<stamp>-heal.{json,md}`` (``--results DIR``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tierckpt.runtime.events import read_events

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "bench" / "heal_job.py"
KILL_AFTER = 12
STEPS = 18
TIMEOUT_S = 600


def _command(mode: str, world: int) -> list[str]:
    if mode == "heal":
        return [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
                "sys.argv[0] = 'tierckpt'; main()", "run", "--nproc-per-node", str(world),
                "--spares", "1", "--", sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(world), "--max-restarts", "1", "--monitor-interval", "0.1"]


def _steps(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.is_file() else []


def one(mode: str, world: int, mib: int, workdir: Path) -> dict[str, Any]:
    """One job of ``mode`` (heal | full), one kill of rank 1; R and its parts."""
    d = workdir / f"{mode}-w{world}-{mib}mib"
    d.mkdir(parents=True)
    t1, log = d / "t1", d / "steps.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TIERCKPT_PROGRESS_EVERY_S": "0"}
    with open(d / "job.log", "w") as out:
        proc = subprocess.Popen([*_command(mode, world), str(JOB), "--tier1", str(t1), "--mib",
                                 str(mib), "--steps", str(STEPS), "--steps-log", str(log)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + TIMEOUT_S
        events = t1 / "events.jsonl"
        while not (len(_steps(log)) > KILL_AFTER and any(
                e["event"] == "save_committed" and e.get("step") == 9
                for e in read_events(events))):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{d}: the job ended or stalled before step {KILL_AFTER}")
            time.sleep(0.02)
        pid = [e["pid"] for e in read_events(events)
               if e["event"] == "process_start" and e["rank"] == 1][-1]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        if proc.wait(TIMEOUT_S) != 0:
            raise RuntimeError(f"{d}: the job failed ({proc.returncode}); see {d / 'job.log'}")
    before = [s["t"] for s in _steps(log) if s["t"] <= t_kill]
    step_s = statistics.median(b - a for a, b in itertools.pairwise(before[1:]))
    evs = [e for e in read_events(events) if e["t"] > t_kill]
    # R ends at the first step after the state was loaded again: a step that rank 0 had
    # under way when rank 1 died can still complete and be logged (its collectives done)
    reloaded = max(e["t"] for e in evs if e["event"] in ("heal_done", "restore_done"))
    after = [s["t"] for s in _steps(log) if s["t"] > reloaded]
    r = after[0] - t_kill
    row: dict[str, Any] = {"mode": mode, "world": world, "mib": mib, "R_s": r,
                           "step_s": step_s, "downtime_s": r - step_s, "outcome": mode}
    lines = [x for x in (d / "job.log").read_text(errors="replace").splitlines()
             if x.startswith("tierckpt run:")]
    if mode == "heal" and (not any(e["event"] == "heal_done" for e in evs)
                           or any("full restart" in x for x in lines)):  # healed, then hung
        row.update(outcome="fell back to a full restart", detect_s=None, reform_s=None,
                   transfer_s=None, first_step_s=None, launcher=lines)
    elif mode == "heal":
        begin = min(e["t"] for e in evs if e["event"] == "heal_begin")
        done = [e for e in evs if e["event"] == "heal_done"]
        loaded = max(e["t"] for e in done)
        row.update(detect_s=begin - t_kill,
                   reform_s=max(e["leave_s"] + e["wait_s"] + e["form_s"] + e["open_s"]
                                for e in done),
                   transfer_s=max(e["restore_s"] for e in done), first_step_s=after[0] - loaded)
    else:
        ready = max(e["t"] for e in evs if e["event"] == "pg_ready")
        loaded = max(e["t"] for e in evs if e["event"] == "restore_done")
        row.update(detect_s=ready - t_kill, reform_s=None, transfer_s=loaded - ready,
                   first_step_s=after[0] - loaded)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per (world, size, mode), and the heal ÷ full ratio."""
    def f(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"
    out = ["| world | state | mode | R (s) | detect (+start) | re-form | transfer | "
           "first step | steady step | heal ÷ full (R) | downtime: R − step (s) | "
           "heal ÷ full (downtime) | outcome |", "|---" * 13 + "|"]
    full = {(r["world"], r["mib"]): r for r in rows if r["mode"] == "full"}

    def ratio(r: dict[str, Any], key: str) -> float | None:
        other = full.get((r["world"], r["mib"]))
        return r[key] / other[key] if r["mode"] == "heal" and other else None

    for r in rows:
        out.append(f"| {r['world']} | {r['mib']} MiB | {r['mode']} | {f(r['R_s'])} | "
                   f"{f(r['detect_s'])} | {f(r['reform_s'])} | {f(r['transfer_s'])} | "
                   f"{f(r['first_step_s'])} | {f(r['step_s'])} | {f(ratio(r, 'R_s'))} | "
                   f"{f(r['downtime_s'])} | {f(ratio(r, 'downtime_s'))} | {r['outcome']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default="2,4")
    p.add_argument("--mib", default="256,1024")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "heal.json")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--results", type=Path, default=None,
                   help="also write <stamp>-heal.json and <stamp>-heal.md into this directory")
    args = p.parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    import tempfile

    rows = []
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for world in (int(w) for w in args.world.split(",")):
            for mib in (int(m) for m in args.mib.split(",")):
                for mode in ("heal", "full"):
                    rows.append(one(mode, world, mib, Path(tmp)))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"started": started, "load_average_end": list(os.getloadavg()), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    md = (f"# tierckpt heal vs full restart — {started}\n\n"
          f"`python -m bench.heal` (see its docstring for what each column is); load average "
          f"at the end {doc['load_average_end']}.\n\n{table(rows)}\n")
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        stamp = started.replace(":", "")
        (args.results / f"{stamp}-heal.json").write_text(json.dumps(doc, indent=2) + "\n")
        (args.results / f"{stamp}-heal.md").write_text(md)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
