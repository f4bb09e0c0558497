"""The torchrun job both launchers run (tierckpt.launch.torchrun): its flags, the check of
what a node asks for, and the same flags in the Slurm script and the k8s launcher."""

from __future__ import annotations

from typing import Any

import pytest

from tierckpt.errors import ConfigError
from tierckpt.launch import k8s, slurm
from tierckpt.launch.command import TrainCommand
from tierckpt.launch.timing import Lead
from tierckpt.launch.torchrun import SIGNALS, TorchrunJob, torchrun_flags

CMD = TrainCommand(None, ("train.py",))
LEAD = Lead(seconds=63, save=None, source="given")


def test_flags_rendezvous_restarts_signals_and_the_lead() -> None:
    job = TorchrunJob(command=CMD, lead=LEAD, nodes=2, spares=1, nproc_per_node="4",
                      max_restarts=5, port=1234)
    assert job.max_nodes == 3
    assert torchrun_flags(job, host="$head", rdzv_id="id-$N") == [
        "--nnodes 2:3", "--nproc-per-node 4", "--rdzv-backend c10d",
        '--rdzv-endpoint "$head:1234"', '--rdzv-id "id-$N"', "--max-restarts 5",
        f"--signals-to-handle {SIGNALS}", "--shutdown-timeout 63"]
    alone = TorchrunJob(command=CMD, lead=LEAD, nproc_per_node="a b")
    assert torchrun_flags(alone, host="h", rdzv_id="i")[:2] == [
        "--nnodes 1", "--nproc-per-node 'a b'"]


def test_check_node_names_the_flag_and_memory_is_in_mib() -> None:
    assert TorchrunJob(command=CMD, lead=LEAD, memory="2G").memory_mib == 2048
    assert TorchrunJob(command=CMD, lead=LEAD).memory_mib == 0
    cases: list[tuple[dict[str, Any], str]] = [
        ({"gpus_per_node": -1}, "--gpus-per-node"),
        ({"cpus_per_node": 1.5}, "--cpus-per-node"), ({"memory": "12"}, "--memory")]
    for kw, flag in cases:
        with pytest.raises(ConfigError, match=flag):
            TorchrunJob(command=CMD, lead=LEAD, **kw).check_node()


def test_both_launchers_run_the_same_torchrun_flags() -> None:
    common: dict[str, Any] = dict(command=CMD, lead=LEAD, nodes=2, spares=1, nproc_per_node="8",
                  max_restarts=4, port=29501)
    script = slurm.sbatch_script(slurm.SlurmLaunch(**common), ["tierckpt"])
    pid1 = k8s.launcher(k8s.K8sLaunch(name="j", image="i", **common), head="h")
    for flag in torchrun_flags(TorchrunJob(**common), host="X", rdzv_id="Y"):
        if "rdzv" not in flag:
            assert flag in script and flag in pid1
    assert '--rdzv-id "$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"' in script
    assert '--rdzv-id "j-${RESTART_ATTEMPT:-0}"' in pid1 and '"h:29501"' in pid1
