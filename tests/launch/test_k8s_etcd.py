"""The job's own etcd in the k8s kit (``tierckpt launch k8s --etcd-members N``,
launch/k8s_etcd.py): the manifest starts the members beside the JobSet, and every pod
waits for them, then runs ``tierckpt run`` against them.

No cluster runs here: the members are started as the kubelet would start the StatefulSet's
pods — the manifest's own command and environment, ``$(POD_NAME)`` expanded from the pod's
name — with the one stand-in that each member's DNS name and fixed ports become its own
loopback ports (three pods share one host here).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests._require import require
from tests.etcdserver import MISSING, etcd_binary
from tierckpt._ports import reserve
from tierckpt.errors import ConfigError
from tierckpt.launch import cluster, k8s, k8s_etcd
from tierckpt.launch.command import split
from tierckpt.launch.timing import Lead

CLI = [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
       "sys.argv[0] = 'tierckpt'; main()"]
ENDPOINT = "etcd://gpt-etcd-0.gpt-etcd:2379,gpt-etcd-1.gpt-etcd:2379,gpt-etcd-2.gpt-etcd:2379"


def _generate(tmp: Path, *extra: str) -> list[dict[str, Any]]:
    out = tmp / "job.yaml"
    subprocess.run([*CLI, "launch", "k8s", "--name", "gpt", "--image", "reg/gpt:1",
                    "--nodes", "2", "--spares", "1", "--nproc-per-node", "2",
                    "--etcd-members", "3", "--etcd-image", "reg/etcd:3.5", "--lead", "60s",
                    *extra, "--out", str(out), "--", "python", "train.py"],
                   check=True, capture_output=True, text=True)
    return list(yaml.safe_load_all(out.read_text()))


def test_the_manifest_starts_the_jobs_etcd_and_every_pod_uses_it(tmp_path: Path) -> None:
    docs = _generate(tmp_path, "--trainjob")
    assert [d["kind"] for d in docs] == ["Service", "StatefulSet", "PodDisruptionBudget",
                                         "JobSet", "TrainJob"]
    svc, sts, pdb = docs[:3]
    assert svc["metadata"]["name"] == "gpt-etcd" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True  # members find each other unready
    spec = sts["spec"]
    assert (spec["serviceName"], spec["replicas"], spec["podManagementPolicy"]) == (
        "gpt-etcd", 3, "Parallel")
    pod = spec["template"]["spec"]
    assert pod["containers"][0]["image"] == "reg/etcd:3.5"
    spread = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
    assert spread[0]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"] \
        == svc["spec"]["selector"] == pdb["spec"]["selector"]["matchLabels"]
    assert spec["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert pdb["spec"]["minAvailable"] == 2  # a drain keeps a majority of 3
    for job_doc in docs[3:]:
        text = yaml.safe_dump(job_doc)
        assert "tierckpt run" in text and ENDPOINT in text
    script = docs[3]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["command"][2]
    wait = script.index(f"tierckpt launch wait-etcd --etcd {ENDPOINT} --within 300 || exit 1")
    assert wait < script.index("trap ") < script.index("tierckpt run")


@pytest.mark.parametrize(("kw", "match"), [
    ({"etcd_members": 2, "etcd_image": "e"}, "--etcd-members 2: give 1, 3, 5 or 7"),
    ({"etcd_members": 3}, "--etcd-members needs --etcd-image"),
    ({"etcd_image": "e"}, "--etcd-image without --etcd-members"),
    ({"etcd_members": 3, "etcd_image": "e", "etcd": "etcd://h:2379"},
     "--etcd and --etcd-members: give one"),
])
def test_bad_etcd_settings_name_the_flag(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        k8s.K8sLaunch(name="gpt", image="i", command=split(["python", "t.py"]),
                      lead=Lead(seconds=60, save=None, source="given"), **kw)


def _kubelet_env(container: dict[str, Any], pod: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it: the downward API's pod name,
    ``$(VAR)`` of an earlier variable expanded."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = pod
        else:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)],
                                       item["value"])
    return env


def _on_loopback(value: str, me: int, ports: list[int]) -> str:
    """The one stand-in: member ``i``'s DNS name and fixed port become loopback and its own
    port; the wildcard listen address becomes this member's own."""
    def member(m: re.Match[str]) -> str:
        i, port = int(m.group(1)), int(m.group(2))
        return f"127.0.0.1:{ports[2 * i + (port == k8s_etcd.PEER_PORT)]}"
    value = re.sub(r"gpt-etcd-(\d)\.gpt-etcd:(\d+)", member, value)
    return re.sub(r"0\.0\.0\.0:(\d+)", lambda m: "127.0.0.1:" + str(
        ports[2 * me + (int(m.group(1)) == k8s_etcd.PEER_PORT)]), value)


@pytest.fixture
def members(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], str]]:
    """The manifest's three members, started as the kubelet would; yields them and the
    job's endpoint as the pods reach them."""
    require(etcd_binary() is not None, MISSING)
    sts = _generate(tmp_path)[1]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    ports = reserve(6)
    procs = []
    try:
        for i in range(sts["spec"]["replicas"]):
            env = {k: _on_loopback(v, i, ports) for k, v in
                   _kubelet_env(container, f"gpt-etcd-{i}").items()}
            env["ETCD_DATA_DIR"] = env["ETCD_DATA_DIR"].replace(
                k8s_etcd.DATA_MOUNT, str(tmp_path / f"pod{i}"))
            exe = shutil.which(container["command"][0])
            assert exe is not None
            with open(tmp_path / f"pod{i}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [exe, *container["command"][1:]], env={"PATH": os.environ["PATH"], **env},
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        yield procs, _on_loopback(ENDPOINT, 0, ports)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(10)


def _wait_etcd(endpoint: str, within_s: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "launch", "wait-etcd", "--etcd", endpoint,
                           "--within", str(within_s)], capture_output=True, text=True)


@pytest.mark.slow
def test_the_members_as_the_kubelet_starts_them_form_one_cluster(
        members: tuple[list[subprocess.Popen[bytes]], str]) -> None:
    """The pods' wait returns once the three members elected a leader; the job keeps its
    store through the loss of one member (what the disruption budget allows), not two."""
    procs, endpoint = members
    up = _wait_etcd(endpoint, 60)
    assert up.returncode == 0, up.stderr
    assert all(p.poll() is None for p in procs)
    ok, line = cluster.probe_etcd(endpoint)
    assert ok and line.startswith("3 of 3 member(s) healthy"), line
    procs[2].kill()
    procs[2].wait(10)
    one_lost = _wait_etcd(endpoint, 10)
    assert one_lost.returncode == 0, one_lost.stderr
    ok, line = cluster.probe_etcd(endpoint)
    assert ok and line.startswith("2 of 3 member(s) healthy"), line
    procs[1].kill()
    procs[1].wait(10)
    two_lost = _wait_etcd(endpoint, 4)
    assert two_lost.returncode == 1
    assert re.search(r"not answering after 4 s: [01] of 3 member\(s\) healthy",
                     two_lost.stderr), two_lost.stderr


def test_a_bad_endpoint_is_a_configuration_error() -> None:
    bad = _wait_etcd("10.0.0.9", 1)
    assert bad.returncode == 2 and "etcd://host:port" in bad.stderr
