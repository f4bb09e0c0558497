"""The launch kit with the job's etcd (``tierckpt launch slurm|k8s --etcd``): every node runs
``tierckpt run --nnodes``, and the step the generated sbatch script runs on each node heals
a lost node for real. The step is taken out of the script as printed and run as ``srun``
would run it on three simulated nodes (one session each, ``$SLURMD_NODENAME`` set per node),
against a real etcd on loopback; one node is killed mid-run and the spare node takes its
rank while the other keeps its process, the losses equal to an uninterrupted run's."""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.etcdserver import EtcdCluster, job_id
from tests.heal.test_heal_jobs import EXAMPLE, SMALL, _env, reference, same_losses
from tests.heal.test_nodes import Cluster, Node
from tierckpt.errors import ConfigError
from tierckpt.launch import k8s, slurm
from tierckpt.launch.command import TrainCommand, split
from tierckpt.launch.timing import Lead
from tierckpt.launch.torchrun import TorchrunJob, heal_flags, node_command
from tierckpt.runtime.etcdstore import EtcdStore

CLI = [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
       "sys.argv[0] = 'tierckpt'; main()"]
LEAD = Lead(seconds=63, save=None, source="given")
ETCD = "etcd://10.0.0.9:2379,10.0.0.10:2379"


def _job(**kw: Any) -> TorchrunJob:
    return TorchrunJob(command=split(["python", "train.py", "--tier1", "$TIERCKPT_TIER1"]),
                       lead=LEAD, **kw)


def test_with_etcd_every_node_runs_tierckpt_run_with_its_spares() -> None:
    job = _job(nodes=2, spares=1, nproc_per_node="8", max_restarts=4, etcd=ETCD)
    assert heal_flags(job, rdzv_id="J-$N", node_id="$NODE") == [
        "--nnodes 2:3", "--nproc-per-node 8", f"--rdzv-endpoint {ETCD}", '--rdzv-id "J-$N"',
        '--node-id "$NODE"', "--max-restarts 4"]
    lines = node_command(job, python="PY", host="h", rdzv_id="J", node_id="N")
    assert lines[0] == "PY -m tierckpt run" and lines[-2] == "--"
    assert lines[-1] == 'PY train.py --tier1 "$TIERCKPT_TIER1"'  # the whole command
    other = TorchrunJob(command=TrainCommand(None, ("--no-python", "./train", "-x")),
                        lead=LEAD, etcd=ETCD)
    assert node_command(other, python="PY", host="h", rdzv_id="J", node_id="N")[-1] == \
        "./train -x"
    plain = node_command(_job(), python="PY", host="h", rdzv_id="J", node_id="N")
    assert plain[0] == "PY -m torch.distributed.run"  # without etcd: torchrun, as before
    assert plain[-1] == 'train.py --tier1 "$TIERCKPT_TIER1"'


def test_both_launchers_name_each_node_and_keep_the_spares_waiting() -> None:
    common: dict[str, Any] = dict(command=split(["python", "train.py"]), lead=LEAD, nodes=2,
                                  spares=1, nproc_per_node="gpu", etcd=ETCD)
    script = slurm.sbatch_script(slurm.SlurmLaunch(**common), ["tierckpt"])
    assert '"$TIERCKPT_PYTHON" -m tierckpt run' in script and "torch.distributed.run" \
        not in script
    assert '--node-id "$SLURMD_NODENAME"' in script and "--no-kill" in script
    pid1 = k8s.launcher(k8s.K8sLaunch(name="j", image="i", **common), head="h")
    assert '--node-id "$POD_NAME"' in pid1 and '--rdzv-id "j-${RESTART_ATTEMPT:-0}"' in pid1
    assert "--nnodes 2:3" in script and "--nnodes 2:3" in pid1


@pytest.mark.parametrize(("kw", "match"), [
    ({"etcd": "http://h:2379"}, "--etcd 'http://h:2379': give the job's etcd as etcd://"),
    ({"etcd": ETCD, "nproc_per_node": "auto"}, "--nproc-per-node 'auto' with --etcd"),
])
def test_bad_heal_settings_name_the_flag(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        _job(**kw).check_node()


def test_the_cli_takes_etcd_for_both_kits(tmp_path: Path) -> None:
    out = tmp_path / "job.yaml"
    done = subprocess.run([*CLI, "launch", "k8s", "--name", "j", "--image", "img",
                           "--nodes", "2", "--spares", "1", "--nproc-per-node", "1",
                           "--etcd", "etcd://etcd.default:2379", "--lead", "60s",
                           "--out", str(out), "--", "python", "train.py"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (jobset,) = yaml.safe_load_all(out.read_text())
    text = yaml.safe_dump(jobset)
    assert "tierckpt run" in text and "etcd://etcd.default:2379" in text
    bad = subprocess.run([*CLI, "launch", "slurm", "--etcd", "10.0.0.9", "--lead", "60s",
                          "--", "python", "train.py"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "etcd://host:port" in bad.stderr


def _step(script: str) -> str:
    """The command the script's ``srun`` runs on every node (its continued lines)."""
    lines = script.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("srun "))
    end = next(i for i in range(start, len(lines)) if lines[i].endswith(" &"))
    body = "\n".join(lines[start + 1:end + 1])
    return body.removesuffix(" &")


class KitNode(Node):
    """One simulated node running the generated step, as ``srun`` starts it there (its
    lines, finish, kill and stop are test_nodes.Node's)."""

    def __init__(self, tmp: Path, name: str, step: str, env: dict[str, str]) -> None:
        self.name, self.killed = name, False
        self.err = tmp / f"{name}.err"
        self.proc = subprocess.Popen(
            ["bash", "-c", step], env={**env, "SLURMD_NODENAME": name},
            stdout=subprocess.DEVNULL, stderr=open(self.err, "w"),  # noqa: SIM115
            start_new_session=True)


@pytest.mark.slow
def test_the_generated_step_heals_a_lost_node(tmp_path: Path,
                                             etcd_server: EtcdCluster) -> None:
    ref = reference(tmp_path / "ref", 2, "--parallel", "ddp")
    losses = tmp_path / "losses.jsonl"
    endpoint = "etcd://" + ",".join(m.url.removeprefix("http://") for m in etcd_server.members)
    script = tmp_path / "job.sbatch"
    gen = subprocess.run(
        [*CLI, "launch", "slurm", "--nodes", "2", "--spares", "1", "--nproc-per-node", "1",
         "--etcd", endpoint, "--lead", "60s", "--out", str(script), "--",
         sys.executable, str(EXAMPLE), "--tier1", "$TIERCKPT_TIER1", "--losses", str(losses),
         *SMALL, "--parallel", "ddp", "--step-sleep", "0.05"],
        capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    jid = job_id()
    env = {**_env(), "SLURM_JOB_ID": jid, "SLURM_RESTART_COUNT": "0",
           "TIERCKPT_PYTHON": sys.executable, "TIERCKPT_TIER1": str(tmp_path / "t1")}
    c = Cluster(tmp_path / "job", etcd_server, "2:3", 1)
    c.store.close()
    c.store = EtcdStore(etcd_server.endpoints, f"{jid}-0",  # the script's --rdzv-id
                        timeout=datetime.timedelta(seconds=30))
    try:
        step = _step(script.read_text())
        for i, name in enumerate(["n0", "n1", "spare"]):
            c.nodes[name] = KitNode(tmp_path, name, step, env)
            if i < 2:
                c.wait_for(f"{name} to hold slot {i}",
                           lambda i=i, name=name: c.holder(i) == name, timeout=60)
        c.wait_for("step 12", lambda: losses.is_file() and
                   len(losses.read_text().splitlines()) >= 13)
        c.nodes["n1"].kill()
        lines = "\n".join(c.nodes[n].finish() for n in ("n0", "spare"))
        assert "[spare]: node n1 lost: slot 1, ranks [1] taken over here" in lines, lines
        assert "full restart" not in lines, lines
        same_losses([json.loads(x) for x in losses.read_text().splitlines()], ref)
        assert c.store.job_keys() == ["nodes/closed", "nodes/done"]  # the last node out cleared
    finally:
        c.close()


def _doctor(tmp: Path, *launch: str) -> tuple[int, dict[str, Any]]:
    script = tmp / "job.sbatch"
    gen = subprocess.run([*CLI, "launch", "slurm", *launch, "--lead", "60s", "--out",
                          str(script), "--", "python", "train.py"],
                         capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    doc = subprocess.run([*CLI, "doctor", "--cluster", "--script", str(script), "--json"],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"})
    return doc.returncode, {c["name"]: c for c in json.loads(doc.stdout)["checks"]}


def test_doctor_checks_the_heal_kit_against_the_real_etcd(
        tmp_path: Path, etcd_server: EtcdCluster) -> None:
    endpoint = "etcd://" + ",".join(m.url.removeprefix("http://") for m in etcd_server.members)
    rc, checks = _doctor(tmp_path, "--nodes", "2", "--spares", "1", "--nproc-per-node", "1",
                         "--etcd", endpoint)
    assert rc == 0, checks
    assert [checks[n]["ok"] for n in ("tierckpt run forwards the notice",
                                      "a spare node waits to take a lost node's ranks",
                                      "the job's etcd answers")] == [True, True, True]
    assert "1 of 1 member(s) healthy" in checks["the job's etcd answers"]["detail"]
    assert re.search(r"database \d+\.\d MiB", checks["the job's etcd answers"]["detail"])
    assert "torchrun forwards the notice" not in checks  # no torchrun in this job


def test_doctor_says_when_the_jobs_etcd_is_full(
        tmp_path: Path, etcd_cluster: Callable[..., EtcdCluster]) -> None:
    """An etcd at its quota refuses every write (a job can neither start nor heal): the
    doctor names the NOSPACE alarm and what to run, where /health alone says only "503"."""
    full = etcd_cluster(1, ("--quota-backend-bytes", str(2 * 2**20)))
    value = base64.b64encode(os.urandom(256 * 1024)).decode()
    for i in range(64):  # 16 MiB of puts into a 2 MiB quota
        req = urllib.request.Request(f"{full.url}/v3/kv/put", method="POST", data=json.dumps(
            {"key": base64.b64encode(f"k{i}".encode()).decode(), "value": value}).encode())
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except urllib.error.HTTPError as e:
            assert "space exceeded" in e.read().decode()
            break
    else:
        raise AssertionError("etcd took 16 MiB into a 2 MiB quota")
    rc, checks = _doctor(tmp_path, "--nodes", "2", "--spares", "1", "--nproc-per-node", "1",
                         "--etcd", "etcd://" + full.url.removeprefix("http://"))
    check = checks["the job's etcd answers"]
    assert rc != 0 and not check["ok"], checks
    assert "0 of 1 member(s) healthy" in check["detail"] and "NOSPACE" in check["detail"]
    assert "etcdctl alarm disarm" in check["detail"] and "MiB" in check["detail"]


def test_doctor_says_what_a_heal_kit_lacks(tmp_path: Path) -> None:
    rc, checks = _doctor(tmp_path, "--nodes", "2", "--nproc-per-node", "1",
                         "--etcd", "etcd://127.0.0.1:9")  # no spare; nothing listens on 9
    assert rc == 1
    spare = checks["a spare node waits to take a lost node's ranks"]
    assert spare["ok"] is False and "--spares 1" in spare["fix"]
    etcd = checks["the job's etcd answers"]
    assert etcd["ok"] is False and "no answer" in etcd["detail"], etcd
    assert "start the job's etcd" in etcd["fix"]


def test_tierckpt_run_takes_gpu_or_a_number_per_node() -> None:
    import torch

    bad = subprocess.run([*CLI, "run", "--nproc-per-node", "x", "--", "true"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--nproc-per-node 'x': give a number" in bad.stderr
    if torch.cuda.device_count() == 0:  # this machine: gpu cannot name a count
        gpu = subprocess.run([*CLI, "run", "--nproc-per-node", "gpu", "--", "true"],
                             capture_output=True, text=True, timeout=120)
        assert gpu.returncode == 2 and "torch sees no GPU" in gpu.stderr, gpu.stderr
