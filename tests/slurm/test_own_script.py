"""Two promises of the Slurm kit, on the real one-node cluster (conftest.py):

- a user's **own** sbatch script — ``#SBATCH --requeue``, srun + torchrun forwarding the
  notice, examples/train.py following the loop contract, and not one line about requeues —
  is requeued after a preemption whose emergency save committed, and resumes from it (the
  job asks Slurm itself: preempt/requeue.py);
- the **generated** script runs torchrun under the interpreter of its tierckpt calls even
  when the ``python`` first on PATH is another one (here a shim that fails and leaves a
  mark).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.runtime import events as ev

from ._cluster import SlurmCluster
from .test_paths import ROOT, TRAIN, Run, _sleeper, finish, resumes, wait_steps

STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def own_script(d: Path, steps: int) -> Path:
    """What a user writes by hand from docs/preemption.md: no launcher, no outcome step."""
    script = d / "own.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --cpus-per-task=2
#SBATCH --output={d / 'job.out'}
export OMP_NUM_THREADS=1 TIERCKPT_PROGRESS_EVERY_S=0
srun --ntasks-per-node=1 {sys.executable} -m torch.distributed.run --standalone \\
    --nproc-per-node 2 --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --shutdown-timeout 30 \\
    {TRAIN} --tier1 {d / 't1'} --steps {steps} --save-every 10 \\
    --losses {d / 'losses.jsonl'} --timeout 60
""")
    return script


@pytest.mark.slow
def test_an_own_script_is_requeued_after_a_preemption(slurm: SlurmCluster,
                                                      tmp_path: Path) -> None:
    steps = 200
    run = Run(slurm.sbatch(own_script(tmp_path, steps), "-p", "low",
                           env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")}), tmp_path)
    wait_steps(slurm, run, 40)
    slurm.sbatch(_sleeper(tmp_path), "-p", "high", "-n", "1", "-o", "/dev/null")  # preempts
    info = finish(slurm, run, STATES)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, run.log()
    [saved, *_] = [e for e in run.events(ev.PREEMPT_SAVED) if e["rank"] == 0]
    [asked, *_] = run.events(ev.SLURM_REQUEUE)
    assert asked["requeued"] is True and asked["rank"] == 0, asked
    assert asked["step"] == saved["step"] and asked["job_id"] == str(run.job)
    assert "preempted; emergency save of step" in asked["why"]
    assert "requeued (scontrol requeue)" in run.log(None)
    pairs = resumes(run)
    assert pairs and pairs[0][1] == saved["step"], pairs  # resumed from the emergency save
    assert all(0 <= last - restored <= 1 for last, restored in pairs), pairs
    assert sorted({r["step"] for r in run.losses}) == list(range(steps))
    # one requeue per preemption: rank 0 asked once
    assert len(run.events(ev.SLURM_REQUEUE)) == int(info["Restarts"])


@pytest.mark.slow
def test_the_generated_script_ignores_another_python_on_path(slurm: SlurmCluster,
                                                           tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    mark = tmp_path / "shim-ran"
    for name in ("python", "python3"):
        exe = shim / name
        exe.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {mark}\nexit 1\n")
        exe.chmod(0o755)
    steps = 30
    gen = subprocess.run(
        [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
         "sys.argv[0] = 'tierckpt'; main()", "launch", "slurm", "--tier1",
         str(tmp_path / "t1"), "--nproc-per-node", "2", "--lead", "30s",
         "--sbatch=--cpus-per-task=2", f"--sbatch=--output={tmp_path / 'job.out'}", "--",
         "python", str(TRAIN), "--tier1", "$TIERCKPT_TIER1", "--steps", str(steps),
         "--save-every", "10", "--losses", str(tmp_path / "losses.jsonl"), "--timeout", "60"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(gen.stdout)
    env = {"PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "TIERCKPT_PROGRESS_EVERY_S": "0", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    assert subprocess.run(["python", "-c", "pass"], env={**os.environ, **env}).returncode == 1
    run = Run(slurm.sbatch(script, "-p", "low", env=env), tmp_path)
    info = finish(slurm, run, STATES)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), run.log()
    assert [r["step"] for r in run.losses] == list(range(steps))
    assert mark.read_text().splitlines() == ["/".join((str(shim), "python")) + " -c pass"]
