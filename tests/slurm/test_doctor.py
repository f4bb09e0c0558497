"""``tierckpt doctor --cluster`` on a good launch and a bad one: a script checked as a file,
and a real Slurm job checking itself from inside (``scontrol``, its batch script, its
partition's GraceTime)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierckpt.cli._app import load_commands

from ._cluster import SlurmCluster
from .test_generate import TRAIN, lead_events

RUNNER = CliRunner()
APP = load_commands()

BAD = """#!/bin/bash
#SBATCH --signal=B:USR1@20
#SBATCH --nodes=1
srun torchrun --nnodes 1 --nproc-per-node 8 train.py
"""


def doctor(*args: str) -> tuple[int, str]:
    r = RUNNER.invoke(APP, ["doctor", "--cluster", *args], env={"COLUMNS": "250"})
    return r.exit_code, r.stdout


def test_a_generated_script_passes(tmp_path: Path) -> None:
    root = lead_events(tmp_path / "t1", 40.0)
    r = RUNNER.invoke(APP, ["launch", "slurm", "--tier1", str(root), "--", *TRAIN])
    script = tmp_path / "job.sbatch"
    script.write_text(r.stdout)
    code, out = doctor("--tier1", str(root), "--script", str(script), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["scheduler"] == "slurm", out
    assert {c["name"]: c["ok"] for c in doc["checks"]} == {
        "torchrun forwards the notice": True, "torchrun waits for the save": True,
        "Slurm warns before the time limit": True, "the lead's signal reaches torchrun": True,
        "Slurm requeues the job": True}
    code, out = doctor("--tier1", str(root), "--script", str(script))
    assert code == 0 and "nothing to fix" in out


def test_a_bad_script_says_what_to_fix(tmp_path: Path) -> None:
    root = lead_events(tmp_path / "t1", 40.0)
    script = tmp_path / "bad.sbatch"
    script.write_text(BAD)
    code, out = doctor("--tier1", str(root), "--script", str(script))
    text = " ".join(out.split())
    assert code == 1 and "fix the checks marked FIX" in text, out
    assert "add SIGUSR1 to torchrun's --signals-to-handle" in text
    assert "raise torchrun's --shutdown-timeout to at least 42 s" in text
    assert "raise the --signal lead to at least 42 s" in text
    assert "submit with #SBATCH --requeue" in text


OWN = """#!/bin/bash
#SBATCH --requeue
#SBATCH --signal=USR1@90
srun python -m torch.distributed.run --signals-to-handle SIGTERM,SIGUSR1 \\
    --shutdown-timeout 90 train.py
"""


def test_a_hand_written_script_with_requeue_passes(tmp_path: Path) -> None:
    """The job requeues itself after its emergency save: a script needs --requeue and
    notices that reach torchrun, no `scontrol requeue` of its own."""
    root = lead_events(tmp_path / "t1", 40.0)
    script = tmp_path / "own.sbatch"
    script.write_text(OWN)
    code, out = doctor("--tier1", str(root), "--script", str(script), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"], out
    [requeue] = [c for c in doc["checks"] if c["name"] == "Slurm requeues the job"]
    assert "the job requeues itself" in requeue["detail"]
    script.write_text(OWN.replace("#SBATCH --requeue\n", ""))  # neither flag: FIX
    code, out = doctor("--tier1", str(root), "--script", str(script), "--json")
    [requeue] = [c for c in json.loads(out)["checks"] if c["name"] == "Slurm requeues the job"]
    assert code == 1 and requeue["ok"] is False and "neither --requeue" in requeue["detail"]


def test_fixes_are_whole_at_80_columns(tmp_path: Path) -> None:
    """Every fix is printed whole, on one line the terminal wraps, at any width."""
    root = lead_events(tmp_path / "t1", 40.0)
    script = tmp_path / "bad.sbatch"
    script.write_text(BAD)
    _, out = doctor("--tier1", str(root), "--script", str(script), "--json")
    fixes = [c["fix"] for c in json.loads(out)["checks"] if c["fix"]]
    assert len(fixes) == 5 and any(len(f) > 80 for f in fixes)
    r = RUNNER.invoke(APP, ["doctor", "--cluster", "--tier1", str(root), "--script",
                            str(script)], env={"COLUMNS": "80"})
    assert r.exit_code == 1
    for fix in fixes:
        assert f"fix:   {fix}\n" in r.stdout, fix
    assert "drop B: (#SBATCH --signal=USR1@LEAD" in r.stdout  # B: without a trap


def test_a_manifest_is_checked_for_its_grace(tmp_path: Path) -> None:
    root = lead_events(tmp_path / "t1", 40.0)
    r = RUNNER.invoke(APP, ["launch", "k8s", "--name", "x", "--image", "i", "--lead", "20s",
                            "--", *TRAIN])
    manifest = tmp_path / "x.yaml"
    manifest.write_text(r.stdout)
    code, out = doctor("--tier1", str(root), "--script", str(manifest), "--json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert code == 1 and checks["the grace period covers the save"]["ok"] is False
    assert "terminationGracePeriodSeconds" in checks["the grace period covers the save"]["fix"]


def test_nothing_to_check_is_unknown_not_ok(tmp_path: Path) -> None:
    code, out = doctor("--json")
    doc = json.loads(out)
    assert code == 0 and [c["ok"] for c in doc["checks"]] == [None]


def test_a_parent_torchrun_is_found_by_walking_up(tmp_path: Path) -> None:
    """Run under a process whose command line is a torchrun's (two levels up): its flags
    are the ones checked, and the check names that process."""
    out, inner = tmp_path / "doctor.json", tmp_path / "doctor.sh"
    inner.write_text(f"{sys.executable} -c 'import sys; from tierckpt.cli import main; "
                     f"sys.argv[0] = \"tierckpt\"; main()' doctor --cluster --json > {out}\n")
    outer = ("true torchrun --signals-to-handle SIGTERM,SIGUSR1 --shutdown-timeout 60 x.py; "
             f"sh {inner}; true")
    proc = subprocess.run(["sh", "-c", outer], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items()
                               if k != "TORCHELASTIC_SIGNALS_TO_HANDLE"})
    assert proc.returncode in (0, 1), proc.stderr
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    notice = checks["torchrun forwards the notice"]
    assert notice["ok"] is True, notice
    assert "the parent torchrun (pid " in notice["detail"], notice


@pytest.mark.slow
def test_inside_a_slurm_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The job checks itself: --requeue from scontrol, the lead from its batch script, the
    preemptible partition's GraceTime (20 s) against a 40 s save: fix the grace."""
    root = lead_events(tmp_path / "t1", 40.0)
    out = tmp_path / "doctor.json"
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --requeue\n#SBATCH --signal=B:USR1@90\n"
        f"{sys.executable} -c 'import sys; from tierckpt.cli import main; "
        f"sys.argv[0] = \"tierckpt\"; main()' doctor --cluster --tier1 {root} --json "
        f"> {out}\n"
        "true torchrun --signals-to-handle SIGTERM,SIGUSR1 --shutdown-timeout 60 x.py\n")
    job = slurm.sbatch(script, "-p", "low", "-o", "/dev/null")
    slurm.wait_job(job, {"COMPLETED", "FAILED"}, 120)
    doc = json.loads(out.read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["scheduler"] == "slurm"
    assert checks["Slurm requeues the job"]["ok"] is True
    assert f"job {job}" in checks["Slurm requeues the job"]["detail"]
    assert checks["Slurm warns before the time limit"]["ok"] is True
    assert checks["torchrun forwards the notice"]["ok"] is True
    grace = checks["the grace period covers the save"]
    assert grace["ok"] is False and "partition low's GraceTime" in grace["detail"]
    assert doc["ok"] is False
