"""Inside a real Slurm job, the library recognises it: :mod:`tierckpt.runtime.scheduler`
reads the job from the environment Slurm gives, and the grace from ``scontrol`` — the batch
script's ``--signal`` lead for USR1 (45 s here, apart from the partition's) and the
``low`` partition's GraceTime for SIGTERM."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from ._cluster import SlurmCluster
from .conftest import GRACE_S

PROBE = """import json, os, sys
from tierckpt.runtime.scheduler import detect, notice_grace
s, g = detect(os.environ), notice_grace(os.environ)
json.dump({"scheduler": s.to_json() if s else None,
           "grace": None if g is None else {"seconds": g.seconds, "by_signal": g.by_signal}},
          open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_a_job_knows_its_id_requeue_and_grace(slurm: SlurmCluster, tmp_path: Path) -> None:
    probe, out = tmp_path / "probe.py", tmp_path / "out.json"
    probe.write_text(PROBE)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --signal=B:USR1@45\n#SBATCH --requeue\n"
                      f"{sys.executable} {probe} {out}\n")
    job = slurm.sbatch(script, "-p", "low", "-o", str(tmp_path / "job.out"))
    info = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").is_file() else ""
    assert info["JobState"] == "COMPLETED", log
    found = json.loads(out.read_text())
    assert found["scheduler"] == {"name": "slurm", "job_id": str(job), "restarts": 0,
                                  "partition": "low", "node": slurm.host}
    by_signal = {signal.Signals(n).name: s for n, s in found["grace"]["by_signal"]}
    assert by_signal == {"SIGUSR1": 45.0, "SIGTERM": float(GRACE_S)}
    assert found["grace"]["seconds"] == float(GRACE_S)
