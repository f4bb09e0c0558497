"""``tierckpt launch k8s``: a JobSet (or a Kubeflow TrainJob) that runs a training command
so that a termination notice ends in a committed emergency save and a restart. Pure: a
value in, manifests (dicts) out; :func:`to_yaml` writes them.

The pod's life: the kubelet sends SIGTERM to PID 1 and SIGKILLs the pod
``terminationGracePeriodSeconds`` later. PID 1 is a small bash launcher (:func:`launcher`)
that forwards SIGTERM to torchrun (which forwards it to the workers: ``--signals-to-handle``),
waits, and exits with ``tierckpt launch outcome``'s status: 75 after an emergency save
(``EXIT_PREEMPTED``), 2 for its own configuration errors, else torchrun's. Then:

- the Job's ``podFailurePolicy`` turns 75 and 2 into ``FailJob`` at once (no pod retries:
  torchrun already restarts ranks inside the pod, ``--max-restarts``);
- the JobSet's ``failurePolicy`` reads the Job's failure message: 75 →
  ``RestartJobSetAndIgnoreMaxRestarts`` (a preemption is not a failure), 2 → ``FailJobSet``;
  any other failure → ``RestartJobSet``, counted against ``maxRestarts``.

The container's environment tells the library where it runs
(:mod:`tierckpt.runtime.scheduler`): ``TIERCKPT_GRACE_S`` is the workers' grace — torchrun's
``--shutdown-timeout``, ``terminationGracePeriodSeconds`` less the teardown — so a SIGTERM's
emergency save plans its copies against the real deadline; ``TIERCKPT_JOB_ID`` (the
JobSet's name), ``RESTART_ATTEMPT`` (the JobSet's restart count) and ``POD_NAME`` go into
each ``process_start`` event.

Tier 0 is an ``emptyDir`` of medium Memory with a ``sizeLimit`` at ``TIERCKPT_TIER0``, where
``Tier0()`` puts its root (:func:`tierckpt.tier0.root.auto_base`); tier 1 a node-local
``hostPath`` of this job's own (default ``/mnt/tierckpt/<name>``: two jobs on one node
never share a tier-1 root) or a PersistentVolumeClaim; tier-2 credentials come from a
Secret (``envFrom``; also files under :data:`TIER2_SECRET_MOUNT`, for a key file), never
from the manifest — whichever store ``TIERCKPT_TIER2`` names (:data:`SECRET_KEYS`). The
training command gets the tier paths as ``TIERCKPT_TIER1`` and ``TIERCKPT_TIER2`` and
passes them to the library (``--tier1 '$TIERCKPT_TIER1'``).

The pods of one job run on distinct nodes (a required pod anti-affinity on the JobSet's
name, per ``kubernetes.io/hostname``): tier 0's partner copy and a node-local tier 1 mean
one node per pod. The container asks for ``nvidia.com/gpu``, CPUs and memory when given
(:func:`tierckpt.launch.resources.k8s_resources`; the memory limit adds tier 0's RAM volume,
which is charged to the container).
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.launch import k8s_etcd
from tierckpt.launch._yaml import dump_all
from tierckpt.launch.outcome import EXIT_CONFIG
from tierckpt.launch.resources import k8s_memory, k8s_resources, parse_memory
from tierckpt.launch.slurm import TIERCKPT_FN, WAIT_STEP
from tierckpt.launch.torchrun import TorchrunJob, node_command
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime.scheduler import GRACE_ENV, JOB_ID_ENV, POD_ENV, RESTARTS_ENV
from tierckpt.tier2.storage.url import CREDENTIAL_ENV, parse_url

CONTAINER = "node"
"""The container's name (Kubeflow Trainer's torch runtime calls its container ``node``)."""
REPLICATED_JOB = "node"
TIER0_MOUNT, TIER1_MOUNT = "/tierckpt/tier0", "/tierckpt/tier1"
TIER1_HOST_BASE = "/mnt/tierckpt"
"""The default tier-1 ``hostPath`` is ``TIER1_HOST_BASE/<name>``."""
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
SECRET_KEYS = tuple(dict.fromkeys(v for names in CREDENTIAL_ENV.values() for v in names))
"""The tier-2 Secret's keys a TrainJob reads, for every object store (``AWS_*``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``...:
:data:`tierckpt.tier2.storage.url.CREDENTIAL_ENV`); a JobSet takes every key
(``envFrom``)."""
TIER2_SECRET_MOUNT = "/tierckpt/tier2-secret"
"""Where the tier-2 Secret's keys are also files (read-only), for credentials that are a
file: a GCS service-account key ``key.json`` in the Secret beside
``GOOGLE_APPLICATION_CREDENTIALS=/tierckpt/tier2-secret/key.json``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class K8sLaunch(TorchrunJob):
    """One job's settings: the :class:`~tierckpt.launch.torchrun.TorchrunJob` and
    Kubernetes' own. ``nodes`` pods train, ``spares`` more join the rendezvous, each pod on
    its own node. ``max_failures``: the JobSet's restarts after failures. ``tier0_size``:
    the tier-0 RAM volume's ``sizeLimit`` (e.g. ``64Gi``; None: no tier 0).
    ``tier1_host_path`` (None: ``/mnt/tierckpt/<name>``) or ``tier1_claim``: tier 1's
    volume. ``tier2``: ``TIERCKPT_TIER2``, a tier-2 URL (checked as the library checks
    it). ``tier2_secret``: a Secret whose keys become the container's environment
    (:data:`SECRET_KEYS`: ``AWS_ACCESS_KEY_ID``, ``AZURE_STORAGE_CONNECTION_STRING``...)
    and files under :data:`TIER2_SECRET_MOUNT`. ``gpus_per_node``, ``cpus_per_node`` and ``memory``
    (what the training needs per pod, e.g. ``512Gi``): the container's resources. Sizes as
    :func:`~tierckpt.launch.resources.parse_memory` reads them. ``etcd_members`` (0: none)
    and ``etcd_image``: the job's own etcd in the manifest
    (:mod:`~tierckpt.launch.k8s_etcd`), which then is the job's ``etcd`` (not given with it)."""

    name: str
    image: str
    max_failures: int = 3
    tier0_size: str | None = None
    tier1_host_path: str | None = None
    tier1_claim: str | None = None
    tier2: str | None = None
    tier2_secret: str | None = None
    python: str = "python3"
    etcd_members: int = 0
    etcd_image: str | None = None

    def __post_init__(self) -> None:
        k8s_etcd.check(self.etcd_members, self.etcd_image)
        if self.etcd_members:
            if self.etcd is not None:
                raise ConfigError("--etcd and --etcd-members: give one (an etcd of your own, "
                                  "or the members the manifest starts for this job)")
            object.__setattr__(self, "etcd", k8s_etcd.endpoint(self.name, self.etcd_members))
        if not self.name or not all(c.isalnum() or c == "-" for c in self.name) \
                or not self.name[0].isalpha() or self.name.lower() != self.name:
            raise ConfigError(f"--name {self.name!r}: use lower-case letters, digits and '-', "
                              "starting with a letter (a DNS label)")
        if self.nodes < 1 or self.spares < 0 or self.max_restarts < 0 or self.max_failures < 0:
            raise ConfigError("--nodes must be at least 1; --spares, --max-restarts and "
                              "--max-failures at least 0")
        if not self.image:
            raise ConfigError("--image: the container image that holds the training code")
        self.check_node()
        if self.tier0_size is not None:
            parse_memory(self.tier0_size, "--tier0-size")
        if self.tier2 is not None:
            parse_url(self.tier2, name="--tier2")
        if self.tier1_host_path is not None and not self.tier1_host_path.startswith("/"):
            raise ConfigError(f"--tier1-host-path {self.tier1_host_path!r}: give an absolute "
                              "path on the node")

    @property
    def pods(self) -> int:
        """The job's pods: one per node, spares included (:attr:`max_nodes`)."""
        return self.max_nodes

    @property
    def host_path(self) -> str:
        """Tier 1's ``hostPath``: the one given, else this job's own directory."""
        return self.tier1_host_path or f"{TIER1_HOST_BASE}/{self.name}"


def launcher(k: K8sLaunch, *, head: str) -> str:
    """PID 1's bash script: forward SIGTERM, run torchrun, exit with the verdict."""
    py = k.command.python or k.python
    torchrun = " \\\n    ".join([
        *node_command(k, python=shlex.quote(py), host=head,
                      rdzv_id=f"{k.name}-${{{RESTARTS_ENV}:-0}}", node_id=f"${POD_ENV}"),
        ]) + " &"
    return "\n".join([
        f'fail() {{ echo "tierckpt launch: $*" >&2; exit {EXIT_CONFIG}; }}',
        '[ -n "${TIERCKPT_TIER1:-}" ] || fail "TIERCKPT_TIER1 is not set"',
        'mkdir -p "$TIERCKPT_TIER1" || fail "cannot create $TIERCKPT_TIER1"',
        "export TIERCKPT_PYTHON=\"${TIERCKPT_PYTHON:-$(command -v " + shlex.quote(py) + ")}\"",
        TIERCKPT_FN, *_wait_etcd(k),
        "start=$(date +%s); notices=''; step=''",
        "# SIGTERM reaches PID 1 only: pass it to torchrun, which passes it to the workers.",
        "trap 'notices=\"$notices term\"; [ -n \"$step\" ] && kill -TERM \"$step\"' TERM",
        torchrun, "step=$!", *WAIT_STEP,
        'tierckpt launch outcome --tier1 "$TIERCKPT_TIER1" --since "$start" \\',
        '    --rc "$rc" --notices "$notices" >/dev/null',
        "",
    ])


ETCD_WAIT_S = 300
"""How long a pod waits for the job's etcd (its members start beside the training pods)."""


def _wait_etcd(k: K8sLaunch) -> list[str]:
    """With the job's etcd: wait until a majority of its members answer (exit 1 after
    :data:`ETCD_WAIT_S`: a failure the JobSet restarts, not a configuration error). Before
    the SIGTERM trap: a termination while waiting ends the pod at once."""
    if k.etcd is None:
        return []
    return [f"tierckpt launch wait-etcd --etcd {shlex.quote(k.etcd)} --within {ETCD_WAIT_S} "
            "|| exit 1"]


def _env(k: K8sLaunch) -> list[dict[str, Any]]:
    """The tier paths, the workers' grace, and the pod's place in the JobSet (downward API)."""
    env: list[dict[str, Any]] = [{"name": "TIERCKPT_TIER1", "value": TIER1_MOUNT}]
    if k.tier0_size:
        env.append({"name": "TIERCKPT_TIER0", "value": TIER0_MOUNT})
    if k.tier2:
        env.append({"name": "TIERCKPT_TIER2", "value": k.tier2})
    env.append({"name": GRACE_ENV, "value": str(k.lead.seconds)})
    for name, path in ((RESTARTS_ENV, f"metadata.annotations['{RESTART_ATTEMPT}']"),
                       (JOB_ID_ENV, f"metadata.labels['{JOBSET_NAME}']"),
                       (POD_ENV, "metadata.name")):
        env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    return env


def _volumes(k: K8sLaunch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tier1: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": k.tier1_claim}} if k.tier1_claim
        else {"hostPath": {"path": k.host_path, "type": "DirectoryOrCreate"}})
    vols = [{"name": "tier1", **tier1}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "tier1", "mountPath": TIER1_MOUNT},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if k.tier0_size:
        size = k8s_memory(parse_memory(k.tier0_size, "--tier0-size"))
        vols.insert(0, {"name": "tier0", "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        mounts.insert(0, {"name": "tier0", "mountPath": TIER0_MOUNT})
    if k.tier2_secret:
        vols.append({"name": "tier2-secret", "secret": {"secretName": k.tier2_secret}})
        mounts.append({"name": "tier2-secret", "mountPath": TIER2_SECRET_MOUNT,
                       "readOnly": True})
    return vols, mounts


def _container(k: K8sLaunch, head: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    c: dict[str, Any] = {"name": CONTAINER, "image": k.image,
                         "command": ["bash", "-c", launcher(k, head=head)],
                         "env": _env(k), "volumeMounts": mounts,
                         "ports": [{"containerPort": k.port, "name": "rdzv"}]}
    if k.tier2_secret:
        c["envFrom"] = [{"secretRef": {"name": k.tier2_secret}}]
    ram = parse_memory(k.tier0_size, "--tier0-size") if k.tier0_size else 0
    resources = k8s_resources(
        gpus=k.gpus_per_node, cpus=k.cpus_per_node, ram_volume_mib=ram,
        memory_mib=k.memory_mib)
    if resources:
        c["resources"] = resources
    return c


def anti_affinity(k: K8sLaunch) -> dict[str, Any]:
    """No two pods of this job on one node (required at scheduling): the JobSet's name
    label, per ``kubernetes.io/hostname``."""
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {JOBSET_NAME: k.name}},
         "topologyKey": HOSTNAME_TOPOLOGY}]}}


def pod_failure_policy() -> dict[str, Any]:
    """Exit 75 (preempted, saved) and 2 (configuration error) fail the Job at once."""
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                              "values": [code]}}
        for code in (EXIT_PREEMPTED, EXIT_CONFIG)]}


def failure_policy(k: K8sLaunch) -> dict[str, Any]:
    """The JobSet's rules, keyed on the Job failure message the pod failure policy writes
    ("... failed with exit code N matching FailJob rule ...")."""
    def rule(name: str, action: str, code: int) -> dict[str, Any]:
        return {"name": name, "action": action, "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [f"exit code {code} matching FailJob rule"],
                "targetReplicatedJobs": [REPLICATED_JOB]}
    return {"maxRestarts": k.max_failures, "rules": [
        rule("preempted-and-saved", "RestartJobSetAndIgnoreMaxRestarts", EXIT_PREEMPTED),
        rule("configuration-error", "FailJobSet", EXIT_CONFIG)]}


def jobset(k: K8sLaunch) -> dict[str, Any]:
    """The JobSet (``jobset.x-k8s.io/v1alpha2``): one replicated Job of ``nodes + spares``
    indexed pods behind the JobSet's headless service; the first pod hosts the c10d
    rendezvous."""
    head = f"{k.name}-{REPLICATED_JOB}-0-0.{k.name}"
    vols, mounts = _volumes(k)
    pod = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "tierckpt"}},
           "spec": {"restartPolicy": "Never",
                    "terminationGracePeriodSeconds": k.lead.k8s_grace_s,
                    "affinity": anti_affinity(k),
                    "containers": [_container(k, head, mounts)], "volumes": vols}}
    job = {"parallelism": k.pods, "completions": k.pods, "completionMode": "Indexed",
           "backoffLimit": 0, "podFailurePolicy": pod_failure_policy(), "template": pod}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": k.name, "annotations": {
                "tierckpt/lead": f"{k.lead.seconds}s: {k.lead.source}"}},
            "spec": {"network": {"enableDNSHostnames": True, "subdomain": k.name},
                     "failurePolicy": failure_policy(k),
                     "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                                         "template": {"spec": job}}]}}


def trainjob(k: K8sLaunch, *, runtime: str = "torch-distributed") -> dict[str, Any]:
    """A Kubeflow Trainer ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``) on ``runtime``:
    the same launcher, rendezvous on the runtime's ``PET_MASTER_ADDR``, and a runtime patch
    for the grace period and the tier volumes. Its failure policy belongs to the runtime
    (docs/schedulers.md shows the rules to put there)."""
    vols, mounts = _volumes(k)
    container = _container(k, "$PET_MASTER_ADDR", mounts)
    pod_patch = {"terminationGracePeriodSeconds": k.lead.k8s_grace_s, "volumes": vols,
                 "affinity": anti_affinity(k),
                 "containers": [{"name": CONTAINER, "volumeMounts": mounts}]}
    env = container["env"] + [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": k.tier2_secret, "key": key,
                                                     "optional": True}}}
        for key in (SECRET_KEYS if k.tier2_secret else ())]
    trainer: dict[str, Any] = {"image": k.image, "command": container["command"],
                               "numNodes": k.pods, "env": env}
    if "resources" in container:
        trainer["resourcesPerNode"] = container["resources"]
    spec: dict[str, Any] = {
        "runtimeRef": {"name": runtime}, "trainer": trainer,
        "runtimePatches": [{"manager": "tierckpt", "trainingRuntimeSpec": {"template": {
            "spec": {"replicatedJobs": [{"name": REPLICATED_JOB, "template": {"spec": {
                "template": {"spec": pod_patch}}}}]}}}}]}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": k.name}, "spec": spec}


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    """The manifests as one YAML stream (``---`` between documents), for ``kubectl apply``."""
    return dump_all(manifests)
