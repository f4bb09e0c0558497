"""A Kubernetes pod's life, emulated with the manifest ``tierckpt launch k8s`` writes.

No cluster runs here, so the test plays the kubelet and the JobSet controller:

- the pod's container runs the manifest's own command (``bash -c LAUNCHER``) as PID 1 of a
  new PID namespace (``unshare --pid --fork --mount-proc``; where that is refused, the root
  of a new session), with the manifest's environment: its values as written, its downward
  API fields (restart attempt, JobSet name, pod name) as the kubelet fills them, and
  ``KUBERNETES_SERVICE_HOST``. The one stand-in: tier 1's volume is a directory of the test
  (``TIERCKPT_TIER1``), and the head pod's DNS name resolves to loopback (a private
  ``/etc/hosts`` in the pod's mount namespace);
- a termination is the kubelet's: SIGTERM to PID 1, then SIGKILL to the whole tree once
  ``terminationGracePeriodSeconds`` have passed;
- the pod's exit code goes through the manifest's ``podFailurePolicy`` and the JobSet's
  ``failurePolicy`` (:func:`jobset_action`) to the action the controller would take.

examples/train.py (FSDP2, 2 gloo ranks) runs in every pod. The paths:

=============  ===========================================  ====  ===============================
path           what happens                                 exit  JobSet action
=============  ===========================================  ====  ===============================
finished       all steps done                               0     the JobSet completes
preempted      SIGTERM mid-training: every rank stops at    75    RestartJobSetAndIgnoreMaxRestarts
               one agreed step and saves it
restarted      the pod again (restart attempt 1): resumes   0     the JobSet completes
               at the saved step + 1, losses bit-identical
config error   TIERCKPT_TIER1 unset                         2     FailJobSet
two jobs       two JobSets of different names, one after    0, 0  each completes
               the other on one node: the second starts
               fresh (each has its own tier-1 hostPath)
=============  ===========================================  ====  ===============================

Where a test names a node (``run_pod(..., node=DIR)``), tier 1's volume is the manifest's
own ``hostPath`` under that directory (the node's file system), not a directory per pod.

With ``TIERCKPT_K8S_PATHS=FILE`` each path appends one JSON line there (the closing table).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierckpt._ports import free_port
from tierckpt.format import layout
from tierckpt.launch import k8s
from tierckpt.launch.command import TrainCommand
from tierckpt.launch.outcome import EXIT_CONFIG
from tierckpt.launch.timing import Lead
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime import events as ev

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
NAME = "emu"
STEPS = 50
LEAD_S = 20
NOTICE_AFTER = 15  # steps trained before the kubelet's SIGTERM
WAIT_S = 300  # a loose hang bound for a pod's whole life


def can_unshare() -> bool:
    """Whether this machine lets us start a PID namespace with its own mount namespace."""
    if shutil.which("unshare") is None:
        return False
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                       capture_output=True, timeout=30)
    return p.returncode == 0


def generate(tmp: Path, port: int, losses: Path, *, name: str = NAME,
             steps: int = STEPS) -> dict[str, Any]:
    """The JobSet ``tierckpt launch k8s`` writes for examples/train.py (one pod, 2 ranks)."""
    gen = subprocess.run(
        [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
         "sys.argv[0] = 'tierckpt'; main()", "launch", "k8s", "--name", name, "--image",
         "local/train:1", "--nproc-per-node", "2", "--lead", f"{LEAD_S}s", "--port",
         str(port), "--", sys.executable, str(TRAIN), "--tier1", "$TIERCKPT_TIER1",
         "--steps", str(steps), "--save-every", "10", "--losses", str(losses),
         "--timeout", "60"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "jobset.yaml").write_text(gen.stdout)
    (js,) = yaml.safe_load_all(gen.stdout)
    return dict(js)


def pod_spec(js: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    return dict(spec["template"]["spec"])


def jobset_action(js: dict[str, Any], code: int) -> str:
    """What the Job and JobSet controllers do when the pod's container exits ``code``: the
    Job's ``podFailurePolicy`` (a FailJob rule writes "... failed with exit code N matching
    FailJob rule at index I"; no rule: ``backoffLimit: 0`` fails the Job), then the first
    JobSet ``failurePolicy`` rule whose reason and message pattern match, else the
    default, ``RestartJobSet`` (counted against ``maxRestarts``)."""
    if code == 0:
        return "Complete"
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    for i, rule in enumerate(job["podFailurePolicy"]["rules"]):
        on = rule["onExitCodes"]
        if on["operator"] == "In" and code in on["values"] and rule["action"] == "FailJob":
            reason = "PodFailurePolicy"
            message = (f"Container {on['containerName']} for pod default/{NAME}-node-0-0-x "
                       f"failed with exit code {code} matching FailJob rule at index {i}")
            break
    for rule in js["spec"]["failurePolicy"]["rules"]:
        if reason in rule["onJobFailureReasons"] and any(
                re.search(p, message) for p in rule["onJobFailureMessagePatterns"]):
            return str(rule["action"])
    return "RestartJobSet"


def pod_env(container: dict[str, Any], *, tier1: Path | None, attempt: int,
            name: str = NAME) -> dict[str, str]:
    """The container's environment as the kubelet would set it (see the module docstring).
    A downward-API field this emulation does not know fails the test (KeyError)."""
    fields = {"metadata.name": f"{name}-node-0-0-x7k2p",
              f"metadata.annotations['{k8s.RESTART_ATTEMPT}']": str(attempt),
              f"metadata.labels['{k8s.JOBSET_NAME}']": name}
    base = ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in base if k in os.environ}
    env.update(KUBERNETES_SERVICE_HOST="10.96.0.1", KUBERNETES_SERVICE_PORT="443",
               HOSTNAME=f"{name}-node-0-0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TIERCKPT_PROGRESS_EVERY_S="0")
    for e in container["env"]:
        env[e["name"]] = (e["value"] if "value" in e
                          else fields[e["valueFrom"]["fieldRef"]["fieldPath"]])
    if tier1 is None:
        env.pop("TIERCKPT_TIER1")
    else:
        env["TIERCKPT_TIER1"] = str(tier1)  # the tier-1 volume's stand-in
    return env


@dataclass
class Pod:
    """One pod's run: its exit code, whether the kubelet had to SIGKILL it, and where it
    wrote."""

    code: int
    killed: bool
    dir: Path
    log: str
    tier1: Path | None = None
    """Tier 1's volume (None: ``dir / "t1"``)."""

    @property
    def losses(self) -> list[dict[str, Any]]:
        p = self.dir / "losses.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] \
            if p.is_file() else []

    def events(self, kind: str, rank: int | None = 0) -> list[dict[str, Any]]:
        p = (self.tier1 or self.dir / "t1") / "events.jsonl"
        return [e for e in ev.read_events(p) if e["event"] == kind
                and (rank is None or e["rank"] == rank)] if p.is_file() else []


def _pid1(root: subprocess.Popen[bytes], isolated: bool) -> int:
    """The host pid of the container's PID 1: unshare's forked child, or the root itself
    (also once the pod has ended: then there is nothing left to signal)."""
    end = time.monotonic() + 30
    while isolated and root.poll() is None and time.monotonic() < end:
        with contextlib.suppress(OSError):
            kids = Path(f"/proc/{root.pid}/task/{root.pid}/children").read_text().split()
            if kids:
                return int(kids[0])
        time.sleep(0.05)
    return root.pid


def host_volume(js: dict[str, Any], node: Path) -> Path:
    """Tier 1's ``hostPath`` in the manifest, on the node whose file system is ``node``."""
    [vol] = [v for v in pod_spec(js)["volumes"] if v["name"] == "tier1"]
    return node / vol["hostPath"]["path"].lstrip("/")


def run_pod(js: dict[str, Any], d: Path, *, attempt: int = 0, tier1: bool = True,
            sigterm_after: int | None = None, node: Path | None = None) -> Pod:
    """Run the manifest's container as a pod in ``d`` until it exits; with
    ``sigterm_after``, the kubelet's termination once that many steps are trained: SIGTERM
    to PID 1, SIGKILL to the tree ``terminationGracePeriodSeconds`` later. With ``node``,
    tier 1 is the manifest's ``hostPath`` on that node (else ``d / "t1"``)."""
    spec = pod_spec(js)
    (container,) = spec["containers"]
    grace = int(spec["terminationGracePeriodSeconds"])
    name = js["metadata"]["name"]
    d.mkdir(parents=True, exist_ok=True)
    volume = host_volume(js, node) if node is not None else d / "t1"
    env = pod_env(container, tier1=volume if tier1 else None, attempt=attempt, name=name)
    command = list(container["command"])
    isolated = can_unshare()
    head = f"{name}-{k8s.REPLICATED_JOB}-0-0.{name}"
    if isolated:
        hosts = d / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + f"127.0.0.1 {head}\n")
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--", "bash", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *command]
    else:  # the launcher is the root of a new session; the head's name is loopback's
        argv = [*command[:2], command[2].replace(head, "127.0.0.1")]
    out = open(d / "pod.log", "wb")  # noqa: SIM115  (closed below, after the pod)
    root = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    killed = False
    try:
        pid1 = _pid1(root, isolated)
        end = time.monotonic() + WAIT_S
        if sigterm_after is not None:
            pod = Pod(0, False, d, "", volume)
            while len(pod.losses) < sigterm_after and root.poll() is None:
                assert time.monotonic() < end, f"no step {sigterm_after}: {_log(d)}"
                time.sleep(0.2)
            assert root.poll() is None, f"the pod ended before the notice: {_log(d)}"
            if isolated:  # the launcher is PID 1 inside the pod's namespace
                assert _namespace_pid(pid1) == 1
            os.kill(pid1, signal.SIGTERM)  # the kubelet's notice, to PID 1 only
            end = time.monotonic() + grace
        try:
            root.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = True  # the grace is over: SIGKILL the whole tree
            _kill_tree(root, pid1)
    finally:
        if root.poll() is None:
            _kill_tree(root, root.pid)
        out.close()
    return Pod(root.returncode, killed, d, _log(d), volume)


def _namespace_pid(pid: int) -> int | None:
    """``pid``'s number inside its own PID namespace (the last of ``NSpid``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return None


def _kill_tree(root: subprocess.Popen[bytes], pid1: int) -> None:
    """SIGKILL PID 1 (in a PID namespace that ends every process in it), then the session
    the pod was started in; wait for the root."""
    for kill, pid in ((os.kill, pid1), (os.killpg, root.pid)):
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)
    root.wait(timeout=60)


def _log(d: Path) -> str:
    p = d / "pod.log"
    return p.read_text(errors="replace")[-6000:] if p.is_file() else ""


def record(path: str, pod: Pod, js: dict[str, Any], **extra: Any) -> None:
    """One line of the closing table (``TIERCKPT_K8S_PATHS``)."""
    if table := os.environ.get("TIERCKPT_K8S_PATHS"):
        with open(table, "a") as f:
            f.write(json.dumps({"path": path, "exit": pod.code, "killed": pod.killed,
                                "action": jobset_action(js, pod.code), **extra}) + "\n")


@pytest.fixture(scope="module")
def jobset(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One manifest for the module and its directory. Its training command writes losses to
    the placeholder ``LOSSES``, which :func:`_for` points into each pod's directory."""
    d = tmp_path_factory.mktemp("k8s")
    return generate(d, free_port(), Path("LOSSES")), d


def _for(js: dict[str, Any], d: Path) -> dict[str, Any]:
    """``js`` with its training command writing its losses into ``d``."""
    text = json.dumps(js).replace("LOSSES", str(d / "losses.jsonl"))
    return dict(json.loads(text))


@pytest.fixture(scope="module")
def finished(jobset: tuple[dict[str, Any], Path]) -> Pod:
    """The finished path, once per module: the uninterrupted reference run, on the node
    ``<module dir>/node`` (tier 1 is the manifest's hostPath there), where it is also the
    first of the two jobs of :func:`test_two_jobs_on_one_node_never_share_tier1`."""
    js, d = jobset
    pod = run_pod(_for(js, d / "finished"), d / "finished", node=d / "node")
    record("finished", pod, js, saved=None, resumed=None, lost=None)
    return pod


@pytest.mark.slow
def test_finished_exits_0_and_the_jobset_completes(
        jobset: tuple[dict[str, Any], Path], finished: Pod) -> None:
    js, _ = jobset
    assert (finished.code, finished.killed) == (0, False), finished.log
    assert jobset_action(js, finished.code) == "Complete"
    assert [r["step"] for r in finished.losses] == list(range(STEPS))
    assert finished.events(ev.PREEMPT_NOTICE) == []
    [start] = finished.events(ev.PROCESS_START)
    assert start["scheduler"] == {"name": "kubernetes", "job_id": NAME, "restarts": 0,
                                  "pod": f"{NAME}-node-0-0-x7k2p"}


@pytest.mark.slow
def test_preempted_exits_75_is_restarted_and_resumes_bit_identically(
        jobset: tuple[dict[str, Any], Path], finished: Pod) -> None:
    js, root = jobset
    d = root / "preempted"
    first = run_pod(_for(js, d), d, sigterm_after=NOTICE_AFTER)
    # The kubelet's SIGTERM: PID 1 passed it on, every rank stopped at one step and saved
    # it, and the pod exited 75 within the grace (no SIGKILL was needed).
    assert (first.code, first.killed) == (EXIT_PREEMPTED, False), first.log
    assert jobset_action(js, first.code) == "RestartJobSetAndIgnoreMaxRestarts"
    [saved] = first.events(ev.PREEMPT_SAVED)
    assert saved["reached"] == ["tier1"]
    step = saved["step"]
    assert (d / "t1" / layout.step_dirname(step) / layout.COMPLETE).exists()
    trained = [r["step"] for r in first.losses]
    assert trained == list(range(step + 1))  # it stopped at the saved step
    assert step >= NOTICE_AFTER - 1
    notices = first.events(ev.PREEMPT_NOTICE, rank=None)
    assert {(n["source"], round(n["deadline_unix"] - n["received_unix"], 3))
            for n in notices if n["source"].startswith("signal:")} == {
        ("signal:SIGTERM", float(LEAD_S))}  # the manifest's TIERCKPT_GRACE_S

    # The JobSet restarts: the same pod again, restart attempt 1.
    again = run_pod(_for(js, d), d, attempt=1)
    assert (again.code, again.killed) == (0, False), again.log
    assert jobset_action(js, again.code) == "Complete"
    [chosen] = [e for e in again.events(ev.CHECKPOINT_CHOSEN) if e.get("step") is not None]
    assert chosen["step"] == step
    resumed = [r["step"] for r in again.losses if r["t"] > chosen["t"]]
    assert resumed[0] == step + 1 and resumed[-1] == STEPS - 1
    lost = trained[-1] - chosen["step"]
    assert 0 <= lost <= 1
    newest = {r["step"]: r["loss_hex"] for r in again.losses}
    assert newest == {r["step"]: r["loss_hex"] for r in finished.losses}
    starts = again.events(ev.PROCESS_START)
    assert [s["scheduler"]["restarts"] for s in starts] == [0, 1]
    record("preempted", first, js, saved=step, resumed=None, lost=lost)
    record("restarted", again, js, saved=None, resumed=resumed[0], lost=None)


@pytest.mark.slow
def test_a_configuration_error_exits_2_and_fails_the_jobset(
        jobset: tuple[dict[str, Any], Path]) -> None:
    js, root = jobset
    pod = run_pod(_for(js, root / "config"), root / "config", tier1=False)
    assert (pod.code, pod.killed) == (EXIT_CONFIG, False), pod.log
    assert "TIERCKPT_TIER1 is not set" in pod.log
    assert jobset_action(js, pod.code) == "FailJobSet"
    record("config error", pod, js, saved=None, resumed=None, lost=None)


@pytest.mark.slow
def test_two_jobs_on_one_node_never_share_tier1(
        jobset: tuple[dict[str, Any], Path], finished: Pod) -> None:
    """Two JobSets of different names, one after the other, on one node with the manifests'
    default tier 1: the first (the module's finished pod, JobSet "emu") leaves its
    checkpoints on the node, the second starts fresh (before, both used /mnt/tierckpt: the
    second restored the first's last step)."""
    js, root = jobset
    node, steps = root / "node", 20
    d = root / "emu-b"
    js_b = generate(d, free_port(), d / "losses.jsonl", name="emu-b", steps=steps)
    jobs = [(finished, js, STEPS), (run_pod(js_b, d, node=node), js_b, steps)]
    for pod, manifest, n in jobs:
        assert (pod.code, pod.killed) == (0, False), pod.log
        assert pod.tier1 == node / "mnt" / "tierckpt" / manifest["metadata"]["name"]
        assert [r["step"] for r in pod.losses] == list(range(n))  # from step 0
        assert [e for e in pod.events(ev.CHECKPOINT_CHOSEN) if e.get("step") is not None] == []
        record("two jobs", pod, manifest, saved=None, resumed=None, lost=None)
    for pod, _, n in jobs:  # each job's checkpoints stay in its own directory
        assert (pod.tier1 / layout.step_dirname(n - 1) / layout.COMPLETE).exists()
        assert {e["scheduler"]["job_id"] for e in pod.events(ev.PROCESS_START)} == {
            pod.tier1.name}


def test_the_failure_policy_maps_each_exit_code() -> None:
    """The controllers' reading of the manifest, on values (no pod runs)."""
    js = k8s.jobset(k8s.K8sLaunch(name=NAME, image="x", command=TrainCommand(
        None, ("train.py",)), lead=Lead(LEAD_S, None, "given")))
    assert [jobset_action(js, c) for c in (0, EXIT_PREEMPTED, EXIT_CONFIG, 1, 137)] == [
        "Complete", "RestartJobSetAndIgnoreMaxRestarts", "FailJobSet", "RestartJobSet",
        "RestartJobSet"]
