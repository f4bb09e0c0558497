"""The test cluster itself: it runs a batch job, and its two partitions are set up so that
a job in ``high`` preempts one in ``low``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._cluster import SlurmCluster


@pytest.mark.slow
def test_the_cluster_runs_a_batch_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\necho hello from $SLURM_JOB_ID\n")
    job = slurm.sbatch(script, "-o", str(tmp_path / "out"))
    info = slurm.wait_job(job, {"COMPLETED", "FAILED"}, 60)
    assert info["JobState"] == "COMPLETED"
    assert (tmp_path / "out").read_text() == f"hello from {job}\n"


@pytest.mark.slow
def test_the_partitions_allow_preemption(slurm: SlurmCluster) -> None:
    low = slurm.run("scontrol", "-o", "show", "partition", "low").stdout
    high = slurm.run("scontrol", "-o", "show", "partition", "high").stdout
    assert "PriorityTier=1" in low and "PreemptMode=REQUEUE" in low
    assert f"GraceTime={slurm.grace_s}" in low
    assert "PriorityTier=2" in high
