"""The scheduler a process runs under, read from its environment: pure detection and
``--signal`` parsing on values; the grace from ``TIERCKPT_GRACE_S`` and from a fake
``scontrol`` on PATH (answering, failing, hanging); and ``init_distributed`` in a real
subprocess with Slurm's or Kubernetes' variables set, whose ``process_start`` event names
the job and its requeue count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierckpt.errors import ConfigError
from tierckpt.runtime.events import read_events
from tierckpt.runtime.scheduler import (
    GRACE_ENV,
    KUBERNETES,
    SLURM,
    SLURM_DEFAULT_LEAD_S,
    Grace,
    Scheduler,
    detect,
    notice_grace,
    sbatch_signal,
)

TERM, USR1 = int(signal.SIGTERM), int(signal.SIGUSR1)

FAKE_SCONTROL = """#!/bin/bash
# A stand-in for Slurm's scontrol: the batch script and the partition of a running job.
case "$1 $2" in
  "write batch_script")
    printf '#!/bin/bash\\n#SBATCH --requeue\\n#SBATCH --signal=B:USR1@45\\nsrun x\\n';;
  "-o show") echo "PartitionName=$4 AllowGroups=ALL GraceTime=20 PreemptMode=REQUEUE State=UP";;
  *) exit 1;;
esac
"""


def fake_scontrol(tmp_path: Path, body: str = FAKE_SCONTROL) -> str:
    """A directory holding an ``scontrol`` that runs ``body``; returns a PATH with it first."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "scontrol"
    exe.write_text(body)
    exe.chmod(0o755)
    return f"{d}:{os.environ.get('PATH', '')}"


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment without any scheduler's or torchrun's variables, plus
    ``extra``: what a subprocess started by a scheduler would see."""
    drop = ("SLURM_", "KUBERNETES_", "TIERCKPT_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
            "TORCHELASTIC_", "GROUP_RANK", "RESTART_ATTEMPT", "POD_NAME")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


# --- detection: values in, values out ----------------------------------------------------

def test_a_slurm_job_is_recognised_with_its_requeue_count() -> None:
    env = {"SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": "2", "SLURM_JOB_PARTITION": "low",
           "SLURMD_NODENAME": "n3", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert detect(env) == Scheduler(SLURM, job_id="812", restarts=2, partition="low",
                                    node="n3")


def test_a_first_slurm_run_has_no_restart_count_and_counts_zero() -> None:
    s = detect({"SLURM_JOB_ID": "9"})
    assert s is not None and s.restarts == 0
    assert s.to_json() == {"name": SLURM, "job_id": "9", "restarts": 0}


def test_a_kubernetes_pod_is_recognised_from_the_downward_api() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "TIERCKPT_JOB_ID": "gpt",
           "RESTART_ATTEMPT": "3", "POD_NAME": "gpt-node-0-1-x7k2p", "HOSTNAME": "h"}
    assert detect(env) == Scheduler(KUBERNETES, job_id="gpt", restarts=3,
                                    pod="gpt-node-0-1-x7k2p")
    bare = detect({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "pod-a"})
    assert bare == Scheduler(KUBERNETES, restarts=0, pod="pod-a")


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": ""}, {"PATH": "/bin"}])
def test_no_scheduler(env: dict[str, str]) -> None:
    assert detect(env) is None


def test_a_malformed_count_is_unknown_not_an_error() -> None:
    s = detect({"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "x"})
    assert s is not None and s.restarts is None and "restarts" not in s.to_json()


@pytest.mark.parametrize(("script", "want"), [
    ("#SBATCH --signal=B:USR1@30\n", (USR1, 30.0)),
    ("#SBATCH --time=1\n#SBATCH --signal=USR1\n", (USR1, SLURM_DEFAULT_LEAD_S)),
    ("#SBATCH --signal=R:SIGTERM@90\n", (TERM, 90.0)),
    ("#SBATCH --signal 10@15\n", (USR1, 15.0)),
    ("#SBATCH --requeue\n# --signal=USR1@5 is not an #SBATCH line\n", None),
    ("#SBATCH --signal=NOPE@5\n", None),
])
def test_the_signal_lead_of_a_batch_script(script: str, want: tuple[int, float] | None
                                           ) -> None:
    assert sbatch_signal(script) == want


def test_grace_per_signal_falls_back_to_the_general_one() -> None:
    g = Grace(seconds=20.0, by_signal=((USR1, 45.0),))
    assert (g.for_signal(USR1), g.for_signal(TERM), Grace().for_signal(TERM)) == (45.0, 20.0,
                                                                                    None)


# --- the grace: the launcher's variable, then Slurm --------------------------------------

def test_the_launchers_grace_wins_and_needs_no_scheduler() -> None:
    g = notice_grace({GRACE_ENV: "40", "SLURM_JOB_ID": "1"})
    assert g is not None and (g.seconds, g.by_signal) == (40.0, ())
    assert notice_grace({}) is None
    assert notice_grace({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) is None


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "nan", "inf"])
def test_a_bad_grace_variable_says_what_to_give(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"{GRACE_ENV}=.*number > 0"):
        notice_grace({GRACE_ENV: raw})


def _grace_in_subprocess(path: str, timeout_s: float = 1.0) -> Grace | None:
    """``notice_grace`` in a fresh process of a Slurm job with ``path`` as its PATH."""
    code = ("import json, sys; from tierckpt.runtime.scheduler import notice_grace\n"
            "import os; g = notice_grace(os.environ, timeout_s=float(sys.argv[1]))\n"
            "print(json.dumps(None if g is None else [g.seconds, g.by_signal, g.source]))")
    env = job_env(SLURM_JOB_ID="77", SLURM_JOB_PARTITION="low", PATH=path)
    p = subprocess.run([sys.executable, "-c", code, str(timeout_s)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    return None if out is None else Grace(out[0], tuple(tuple(x) for x in out[1]), out[2])


def test_slurm_gives_the_signal_lead_and_the_partitions_grace_time(tmp_path: Path) -> None:
    g = _grace_in_subprocess(fake_scontrol(tmp_path))
    assert g is not None
    assert (g.for_signal(USR1), g.for_signal(TERM), g.seconds) == (45.0, 20.0, 20.0)
    assert "--signal SIGUSR1@45" in g.source and "partition low's GraceTime" in g.source


def test_a_partition_without_preemption_gives_no_grace_time(tmp_path: Path) -> None:
    body = FAKE_SCONTROL.replace("PreemptMode=REQUEUE", "PreemptMode=OFF")
    g = _grace_in_subprocess(fake_scontrol(tmp_path, body))
    assert g is not None and g.by_signal == ((USR1, 45.0),) and g.seconds is None


@pytest.mark.parametrize("body", ["#!/bin/bash\nexit 1\n", "#!/bin/bash\nexec sleep 30\n"])
def test_a_failing_or_hanging_scontrol_only_loses_the_source(tmp_path: Path,
                                                             body: str) -> None:
    t0 = time.monotonic()
    assert _grace_in_subprocess(fake_scontrol(tmp_path, body), timeout_s=1.0) is None
    assert time.monotonic() - t0 < 25  # a loose hang bound: the 30 s sleep was cut short


def test_without_scontrol_there_is_no_slurm_grace(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _grace_in_subprocess(f"{empty}:{Path(sys.executable).parent}") is None


# --- init_distributed records the scheduler ----------------------------------------------

INIT = ("import json, sys, tierckpt\n"
        "info = tierckpt.init_distributed(event_log=sys.argv[1])\n"
        "print(json.dumps(info.scheduler.to_json() if info.scheduler else None))\n")


@pytest.mark.parametrize(("extra", "want"), [
    ({"SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": "1", "SLURM_JOB_PARTITION": "low"},
     {"name": SLURM, "job_id": "812", "restarts": 1, "partition": "low"}),
    ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "TIERCKPT_JOB_ID": "gpt",
      "RESTART_ATTEMPT": "2", "POD_NAME": "gpt-node-0-0-abcde"},
     {"name": KUBERNETES, "job_id": "gpt", "restarts": 2, "pod": "gpt-node-0-0-abcde"}),
    ({}, None),
])
def test_process_start_names_the_job_and_its_requeue(
        tmp_path: Path, extra: dict[str, str], want: dict[str, object] | None) -> None:
    events = tmp_path / "events.jsonl"
    p = subprocess.run([sys.executable, "-c", INIT, str(events)], env=job_env(**extra),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == want
    [start] = [e for e in read_events(events) if e["event"] == "process_start"]
    assert start.get("scheduler") == want
    assert start["restart_count"] == 0  # torchrun's count stays its own
