"""Every way a Slurm job ends, for real: the script ``tierckpt launch slurm`` writes runs
examples/train.py (FSDP2, 2 gloo ranks on one node) on the test cluster, and each path
ends the right way:

===================  ===========================================  ==================
path                 what happens                                 final state
===================  ===========================================  ==================
all steps done       the step exits 0                             COMPLETED, 0 requeues
preempted            SIGTERM to the step; saved; ``scontrol       COMPLETED after >= 1
                     requeue``; resumes from the emergency save   requeue
time limit           ``--signal=B:USR1@lead`` → saved → requeued  COMPLETED after >= 1
                                                                  requeue
scancel              the batch shell gets SIGTERM: not requeued   CANCELLED, 0 requeues
a rank killed        torchrun restarts it inside the allocation   COMPLETED, 0 requeues
===================  ===========================================  ==================

Each check reads the final state from ``scontrol show job`` (JobState, Restarts), the
per-step losses (rank 0 appends one line per step, across every run) and the tier-1 root's
events. Lost work after an announced interruption is at most one step, and the losses
equal an uninterrupted run's bit for bit. A requeued job's runs name the job and their
requeue count in ``process_start``, and each notice's grace is Slurm's: the partition's
GraceTime after a preemption's SIGTERM, the ``--signal`` lead after its USR1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tierckpt.runtime import events as ev

from ._cluster import SlurmCluster, _free_ports
from .conftest import GRACE_S

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
STEPS = 400
WAIT_S = 300


@dataclass
class Run:
    """One submitted job and where it writes."""

    job: int
    dir: Path
    t0: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def losses(self) -> list[dict[str, Any]]:
        p = self.dir / "losses.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] \
            if p.is_file() else []

    def events(self, kind: str) -> list[dict[str, Any]]:
        p = self.dir / "t1" / "events.jsonl"
        return [e for e in ev.read_events(p) if e["event"] == kind] if p.is_file() else []

    def log(self, tail: int | None = 6000) -> str:
        """The job's output (every run appends to it): its last ``tail`` characters, for a
        failure message, or all of it (None) to look for a line."""
        p = self.dir / "job.out"
        text = p.read_text(errors="replace") if p.is_file() else ""
        return text if tail is None else text[-tail:]


def submit(slurm: SlurmCluster, d: Path, *, steps: int = STEPS, lead: int = 30,
           sbatch: tuple[str, ...] = (), train: tuple[str, ...] = (),
           launch: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Run:
    """Write the script with ``tierckpt launch slurm`` (``launch``: more of its flags) and
    submit it to ``low`` (``env``: more of the job's environment)."""
    d.mkdir(parents=True, exist_ok=True)
    (port,) = _free_ports(1)
    gen = subprocess.run(
        [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
         "sys.argv[0] = 'tierckpt'; main()", "launch", "slurm",
         "--tier1", str(d / "t1"), "--nproc-per-node", "2", "--lead", f"{lead}s",
         "--port", str(port), "--max-restarts", "2", "--sbatch=--cpus-per-task=2",
         f"--sbatch=--output={d / 'job.out'}", *(f"--sbatch={o}" for o in sbatch), *launch,
         "--",
         sys.executable, str(TRAIN), "--tier1", "$TIERCKPT_TIER1", "--steps", str(steps),
         "--save-every", "10", "--losses", str(d / "losses.jsonl"), "--timeout", "60",
         *train], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr
    script = d / "job.sbatch"
    script.write_text(gen.stdout)
    job_env = {"OMP_NUM_THREADS": "1", "TIERCKPT_PROGRESS_EVERY_S": "0",
               "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **(env or {})}
    return Run(slurm.sbatch(script, "-p", "low", env=job_env), d)


def wait_steps(slurm: SlurmCluster, run: Run, n: int) -> None:
    """Wait until the job has trained ``n`` steps (since it started)."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        if len(run.losses) >= n:
            return
        assert slurm.job(run.job).get("JobState") in ("PENDING", "RUNNING"), run.log()
        time.sleep(0.5)
    raise TimeoutError(f"job {run.job} did not reach {n} steps\n{run.log()}")


def finish(slurm: SlurmCluster, run: Run, states: set[str],
           wait_s: float = WAIT_S) -> dict[str, str]:
    """Wait up to ``wait_s`` for one of ``states`` (pulling requeued starts forward); the
    job's record. With ``TIERCKPT_SLURM_PATHS=FILE`` one JSON line per job goes there too
    (the closing table: state, requeues, resumes, lost steps, wall time)."""
    try:
        info = slurm.wait_job(run.job, states, wait_s)
    except TimeoutError as e:
        raise AssertionError(f"{e}\n--- job.out\n{run.log()}") from None
    if table := os.environ.get("TIERCKPT_SLURM_PATHS"):
        with open(table, "a") as f:
            f.write(json.dumps({"dir": run.dir.name, "state": info.get("JobState"),
                                "restarts": info.get("Restarts"), "resumes": resumes(run),
                                "saved": [e["step"] for e in run.events(ev.PREEMPT_SAVED)
                                          if e["rank"] == 0],
                                "wall_s": round(time.monotonic() - run.t0, 1)}) + "\n")
    return info


def resumes(run: Run) -> list[tuple[int, int]]:
    """(last step trained before, step restored) at each resume: rank 0's
    ``checkpoint_chosen`` events with a step, against the losses logged before them."""
    losses = run.losses
    out = []
    for e in run.events(ev.CHECKPOINT_CHOSEN):
        if e["rank"] == 0 and e.get("step") is not None:
            before = [r["step"] for r in losses if r["t"] < e["t"]]
            out.append((max(before), e["step"]))
    return out


def requeues_started(run: Run) -> list[int]:
    """The requeue count (``SLURM_RESTART_COUNT``) of each run that started training, in
    order, from rank 0's ``process_start`` events; each must name this job."""
    starts = [e for e in run.events(ev.PROCESS_START) if e["rank"] == 0]
    assert all(e["scheduler"]["name"] == "slurm" and e["scheduler"]["job_id"] == str(run.job)
               and e["scheduler"]["partition"] == "low" for e in starts), starts
    return [e["scheduler"]["restarts"] for e in starts]


def graces(run: Run) -> list[tuple[str, float]]:
    """(source, deadline - receipt) of every notice a rank received itself."""
    return [(e["source"], round(e["deadline_unix"] - e["received_unix"], 3))
            for e in run.events(ev.PREEMPT_NOTICE) if e["source"].startswith("signal:")]


def lost_steps(pairs: list[tuple[int, int]]) -> list[int]:
    """Steps trained again at each resume (0: it resumed right after the last one)."""
    return [last - restored for last, restored in pairs]


def same_losses(run: list[dict[str, Any]], reference: dict[int, str]) -> None:
    """Every step's loss (the newest run of it) equals the uninterrupted run's bit for bit."""
    newest = {r["step"]: r["loss_hex"] for r in run}
    assert sorted(newest) == sorted(reference)
    assert newest == reference


@pytest.fixture(scope="module")
def reference(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Any]:
    """The uninterrupted run (the "all steps done" path), once per module."""
    slurm_cluster.cancel_all()
    run = submit(slurm_cluster, tmp_path_factory.mktemp("reference"))
    info = finish(slurm_cluster, run, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    return {"info": info, "run": run, "hex": {r["step"]: r["loss_hex"] for r in run.losses}}


@pytest.mark.slow
def test_all_steps_done_is_completed_not_requeued(reference: dict[str, Any]) -> None:
    info, run = reference["info"], reference["run"]
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), run.log()
    assert [r["step"] for r in run.losses] == list(range(STEPS))
    assert "no notice: the job finished" in run.log(None)
    assert run.events(ev.PREEMPT_NOTICE) == []


@pytest.mark.slow
def test_preempted_is_requeued_and_resumes_from_the_emergency_save(
        slurm: SlurmCluster, tmp_path: Path, reference: dict[str, Any]) -> None:
    run = submit(slurm, tmp_path)
    wait_steps(slurm, run, 60)
    slurm.sbatch(_sleeper(tmp_path), "-p", "high", "-n", "1", "-o", "/dev/null")  # preempts
    info = finish(slurm, run, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, run.log()
    saved = run.events(ev.PREEMPT_SAVED)
    assert saved and "preempted; emergency save" in run.log(None)
    pairs = resumes(run)
    assert pairs and all(0 <= n <= 1 for n in lost_steps(pairs)), pairs
    assert pairs[0][1] == saved[0]["step"]  # resumed from the emergency save
    same_losses(run.losses, reference["hex"])
    # The library knew the job: each run's process_start names it and its requeue, and
    # Slurm's SIGTERM got the partition's GraceTime as its grace.
    assert requeues_started(run) == list(range(int(info["Restarts"]) + 1))
    assert set(graces(run)) == {("signal:SIGTERM", float(GRACE_S))}


@pytest.mark.slow
@pytest.mark.timeout(900)  # up to 16 one-minute allocations; ~2 min on an idle machine
def test_time_limit_with_signal_is_requeued_and_resumes(
        slurm: SlurmCluster, tmp_path: Path, reference: dict[str, Any]) -> None:
    """A 1-minute limit and a 20 s lead: USR1 comes 20-50 s before the limit (slurmctld
    looks every 30 s), while the 240 steps train; each run saves, requeues, and the next
    resumes, until all are done. 0.2 s per step makes the work (48 s) longer than one
    allocation trains on any machine (at most 40 s before its USR1: a fast one once
    finished 600 plain steps); on a loaded one a run may train only a few seconds after
    its start-up (26 steps a run once, with two other lanes of tests beside it), so the job
    may requeue up to 16 times (``--max-requeues``: the script exports it as
    TIERCKPT_MAX_REQUEUES, over anything in the submitting environment)."""
    run = submit(slurm, tmp_path, steps=240, lead=20, sbatch=("--time=1",),
                 train=("--step-sleep", "0.2"), launch=("--max-requeues", "16"))
    info = finish(slurm, run, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, wait_s=840)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, run.log()
    assert "time limit ahead (--signal); emergency save" in run.log(None)
    assert all(e["source"] == "signal:SIGUSR1" for e in run.events(ev.PREEMPT_NOTICE))
    pairs = resumes(run)
    assert pairs and all(0 <= n <= 1 for n in lost_steps(pairs)), pairs
    assert sorted({r["step"] for r in run.losses}) == list(range(240))
    assert requeues_started(run) == list(range(int(info["Restarts"]) + 1))
    assert set(graces(run)) == {("signal:SIGUSR1", 20.0)}  # the --signal lead


@pytest.mark.slow
def test_scancel_is_cancelled_not_requeued(slurm: SlurmCluster, tmp_path: Path) -> None:
    run = submit(slurm, tmp_path, steps=4000)
    wait_steps(slurm, run, 30)
    slurm.run("scancel", str(run.job))
    info = finish(slurm, run, {"CANCELLED", "COMPLETED", "FAILED", "PENDING"})
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", run.log()
    time.sleep(7)  # past KillWait (5 s): the batch shell has ended, requeued or not
    info = slurm.job(run.job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), run.log()


@pytest.mark.slow
def test_a_rank_killed_restarts_inside_the_allocation(
        slurm: SlurmCluster, tmp_path: Path, reference: dict[str, Any]) -> None:
    run = submit(slurm, tmp_path, train=("--kill-at", "35", "--kill-rank", "1"))
    info = finish(slurm, run, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), run.log()
    pairs = resumes(run)
    assert len(pairs) == 1 and pairs[0] == (35, 29), pairs  # from the save of step 29
    assert max(r["attempt"] for r in run.losses) == 1  # torchrun's restart, no requeue
    same_losses(run.losses, reference["hex"])


def _sleeper(d: Path) -> Path:
    s = d / "high.sh"
    s.write_text("#!/bin/bash\nsleep 1\n")
    return s
