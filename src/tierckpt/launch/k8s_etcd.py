"""The job's own etcd for ``tierckpt launch k8s --etcd-members N``: a StatefulSet of ``N``
etcd members behind a headless Service, and a PodDisruptionBudget that keeps a majority up.
Pure: a :class:`~tierckpt.launch.k8s.K8sLaunch` in, manifests (dicts) out.

What the manifests promise (docs/schedulers.md):

- member ``i`` is the pod ``NAME-etcd-i``, reached as ``NAME-etcd-i.NAME-etcd`` (the
  Service publishes members before they are ready: they must find each other to elect a
  leader); the job's endpoint (:func:`endpoint`) names every member's client port;
- the members start together (``podManagementPolicy: Parallel``: a cluster bootstraps only
  once a majority runs), each on its own node (a required pod anti-affinity), each with
  its data on a PersistentVolumeClaim (the cluster's default storage class), so that a
  member rescheduled after its node went down rejoins with its data;
- etcd compacts its own history every 5 minutes (as the supervisors do, docs/heal.md),
  and answers ``GET /health`` for its readiness;
- a drain never takes more than ``N - (N // 2 + 1)`` members at once.

etcd is configured by its environment (``ETCD_*``, etcd 3.4 and later), the same in every
pod but for ``$(POD_NAME)``, which Kubernetes expands from the downward API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierckpt.errors import ConfigError

if TYPE_CHECKING:
    from tierckpt.launch.k8s import K8sLaunch

CLIENT_PORT = 2379
PEER_PORT = 2380
DATA_MOUNT = "/var/lib/etcd"
SIZES = (1, 3, 5, 7)
"""The member counts taken: odd (an even count survives no more losses than one fewer)."""
STORAGE = "1Gi"
"""Each member's volume: the job's keys stay far below etcd's 2 GiB quota once compacted
(about 115 MB a day per node before compaction)."""
ROLE_LABEL = "tierckpt/etcd"


def service_name(name: str) -> str:
    """The etcd Service (and StatefulSet) of job ``name``: ``NAME-etcd``."""
    return f"{name}-etcd"


def member_host(name: str, i: int) -> str:
    """Member ``i``'s DNS name inside the namespace: ``NAME-etcd-i.NAME-etcd``."""
    svc = service_name(name)
    return f"{svc}-{i}.{svc}"


def endpoint(name: str, members: int) -> str:
    """The job's ``--etcd``: every member's client URL, ``etcd://h:2379,...``."""
    return "etcd://" + ",".join(f"{member_host(name, i)}:{CLIENT_PORT}"
                                for i in range(members))


def check(members: int, image: str | None) -> None:
    """ConfigError naming the flag unless ``members`` is an odd count up to 7 and an image
    is given (0 members: no etcd of the job's own, no image)."""
    if members == 0:
        if image:
            raise ConfigError("--etcd-image without --etcd-members: give the member count "
                              "(3: a member may be lost)")
        return
    if members not in SIZES:
        raise ConfigError(f"--etcd-members {members}: give 1, 3, 5 or 7 (an odd count; 3 "
                          "keeps the job's store through the loss of any one node)")
    if not image:
        raise ConfigError("--etcd-members needs --etcd-image: the etcd image (3.4 or later) "
                          "your cluster pulls, e.g. your registry's copy of etcd's release "
                          "image")


def _env(k: K8sLaunch) -> list[dict[str, Any]]:
    svc = service_name(k.name)
    me = f"$(POD_NAME).{svc}"
    cluster = ",".join(f"{svc}-{i}=http://{member_host(k.name, i)}:{PEER_PORT}"
                       for i in range(k.etcd_members))
    values = {
        "ETCD_NAME": "$(POD_NAME)",
        "ETCD_DATA_DIR": f"{DATA_MOUNT}/data",
        "ETCD_LISTEN_CLIENT_URLS": f"http://0.0.0.0:{CLIENT_PORT}",
        "ETCD_ADVERTISE_CLIENT_URLS": f"http://{me}:{CLIENT_PORT}",
        "ETCD_LISTEN_PEER_URLS": f"http://0.0.0.0:{PEER_PORT}",
        "ETCD_INITIAL_ADVERTISE_PEER_URLS": f"http://{me}:{PEER_PORT}",
        "ETCD_INITIAL_CLUSTER": cluster,
        "ETCD_INITIAL_CLUSTER_STATE": "new",
        "ETCD_INITIAL_CLUSTER_TOKEN": svc,
        "ETCD_AUTO_COMPACTION_MODE": "periodic",
        "ETCD_AUTO_COMPACTION_RETENTION": "5m",
    }
    return [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *({"name": key, "value": v} for key, v in values.items())]


def _labels(k: K8sLaunch) -> dict[str, str]:
    return {ROLE_LABEL: k.name, "app.kubernetes.io/managed-by": "tierckpt"}


def service(k: K8sLaunch) -> dict[str, Any]:
    """The headless Service that names each member (``publishNotReadyAddresses``)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": service_name(k.name), "labels": _labels(k)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {ROLE_LABEL: k.name},
                     "ports": [{"name": "client", "port": CLIENT_PORT},
                               {"name": "peer", "port": PEER_PORT}]}}


def statefulset(k: K8sLaunch) -> dict[str, Any]:
    """The members: ``k.etcd_members`` pods of ``k.etcd_image``, one per node."""
    svc = service_name(k.name)
    container = {
        "name": "etcd", "image": k.etcd_image, "command": ["etcd"], "env": _env(k),
        "ports": [{"containerPort": CLIENT_PORT, "name": "client"},
                  {"containerPort": PEER_PORT, "name": "peer"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": CLIENT_PORT},
                           "periodSeconds": 5},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "volumeMounts": [{"name": "data", "mountPath": DATA_MOUNT}]}
    spread = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {ROLE_LABEL: k.name}},
         "topologyKey": "kubernetes.io/hostname"}]}}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": svc, "labels": _labels(k)},
            "spec": {"serviceName": svc, "replicas": k.etcd_members,
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": {ROLE_LABEL: k.name}},
                     "template": {"metadata": {"labels": _labels(k)},
                                  "spec": {"affinity": spread, "containers": [container]}},
                     "volumeClaimTemplates": [{
                         "metadata": {"name": "data"},
                         "spec": {"accessModes": ["ReadWriteOnce"],
                                  "resources": {"requests": {"storage": STORAGE}}}}]}}


def budget(k: K8sLaunch) -> dict[str, Any]:
    """A PodDisruptionBudget: a drain keeps a majority of the members."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": service_name(k.name), "labels": _labels(k)},
            "spec": {"minAvailable": k.etcd_members // 2 + 1,
                     "selector": {"matchLabels": {ROLE_LABEL: k.name}}}}


def manifests(k: K8sLaunch) -> list[dict[str, Any]]:
    """The job's etcd (Service, StatefulSet, PodDisruptionBudget); none without
    ``k.etcd_members``."""
    return [service(k), statefulset(k), budget(k)] if k.etcd_members else []
