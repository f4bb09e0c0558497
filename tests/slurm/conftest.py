"""The Slurm tests' cluster: one real one-node cluster per test session (see _cluster.py).

``slurm`` is what a test asks for: the session's cluster, with every job cancelled and the
node idle again after the test. Where Slurm is not installed the tests skip — except under
``CI=true``, where ``.ci/run`` installs it, so they fail (tests/_require.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests._require import require

from ._cluster import SlurmCluster, missing_tools

GRACE_S = 20
"""The ``low`` partition's GraceTime: a preempted job's notice → kill."""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The session's one-node cluster, started once and stopped (no process left) at the
    end of the session."""
    missing = missing_tools()
    require(not missing, f"Slurm is not installed (missing {', '.join(missing)}): "
                         "apt-get install --no-install-recommends slurmctld slurmd munge "
                         "slurm-client")
    require(os.geteuid() == 0, "the Slurm test cluster runs its daemons as root")
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), grace_s=GRACE_S) as cluster:
        yield cluster


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster for one test; every job is cancelled afterwards."""
    yield slurm_cluster
    slurm_cluster.cancel_all()
