"""Tier-2 credentials reach the workers for every object store, as ``AWS_*`` do for ``s3://``:
the Kubernetes Secret's keys (a JobSet's ``envFrom``, a TrainJob's ``secretKeyRef`` per
key, and the Secret's files for a GCS key file), and the Slurm script's environment (sbatch
exports it; an ``--export`` that would drop it is refused). Manifests and scripts only: no
cluster."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.slurm.test_generate import TRAIN, _model_errors, _unknown_keys, launch
from tierckpt.cli._app import app
from tierckpt.launch import k8s
from tierckpt.tier2.storage.url import CREDENTIAL_ENV

GCS_VARS = ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")
AZURE_VARS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
              "AZURE_STORAGE_KEY")
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _k8s(url: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(launch(
        "k8s", "--name", "gpt", "--image", "registry.local/gpt:1", "--tier2", url,
        "--tier2-secret", "tier2-creds", "--trainjob", "--", *TRAIN)))


def test_the_secret_keys_cover_every_store() -> None:
    for var in (*AWS_VARS, *GCS_VARS, *AZURE_VARS):
        assert var in k8s.SECRET_KEYS, var
    assert set(k8s.SECRET_KEYS) == {v for names in CREDENTIAL_ENV.values() for v in names}
    assert len(set(k8s.SECRET_KEYS)) == len(k8s.SECRET_KEYS)


@pytest.mark.parametrize("url", ["gs://ckpt-bucket/run-7", "az://ckpt-box/run-7"])
def test_a_jobset_gives_the_pod_the_secret_as_environment_and_files(url: str) -> None:
    import kubernetes_validate as kv

    js = _k8s(url)[0]
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    assert c["envFrom"] == [{"secretRef": {"name": "tier2-creds"}}]  # every key, any store
    assert {e["name"]: e.get("value") for e in c["env"]}["TIERCKPT_TIER2"] == url
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["tier2-secret"]["secret"] == {"secretName": "tier2-creds"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["tier2-secret"] == {"name": "tier2-secret", "readOnly": True,
                                      "mountPath": k8s.TIER2_SECRET_MOUNT}
    kv.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "gpt-node-0"},
                 "spec": job}, "1.33", strict=True)


def test_a_trainjob_reads_each_stores_keys_from_the_secret() -> None:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    tj = _k8s("gs://ckpt-bucket/run-7")[1]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in tj["spec"]["trainer"]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}
    for var in (*AWS_VARS, *GCS_VARS, *AZURE_VARS):
        assert refs[var] == {"name": "tier2-creds", "key": var, "optional": True}, var
    patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"name": "tier2-secret", "secret": {"secretName": "tier2-creds"}} in pod["volumes"]
    assert _model_errors(TrainerV1alpha1TrainJob, tj) == []
    assert _unknown_keys(TrainerV1alpha1TrainJob, tj) == []


def test_without_a_secret_nothing_is_mounted() -> None:
    js = yaml.safe_load(launch("k8s", "--name", "gpt", "--image", "i:1", "--tier2",
                               "gs://ckpt-bucket/run-7", "--", *TRAIN))
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "tier2-secret" not in {v["name"] for v in pod["volumes"]}
    assert "envFrom" not in pod["containers"][0]


def test_the_slurm_script_keeps_the_environment_and_names_each_stores_variables() -> None:
    script = launch("slurm", "--tier1", "/scratch/t1", "--tier2", "az://ckpt-box/run-7", "--",
                    *TRAIN)
    assert 'export TIERCKPT_TIER2="${TIERCKPT_TIER2:-az://ckpt-box/run-7}"' in script
    assert "--export" not in script  # sbatch's default: the submitter's whole environment
    for scheme, names in CREDENTIAL_ENV.items():
        assert f"#   {scheme}://  {' '.join(names)}" in script


@pytest.mark.parametrize("argv", [
    ["slurm", "--sbatch=--export=NONE"],
    ["slurm", "--sbatch=--export=TIERCKPT_TIER1"],
    ["slurm", "--tier2", "gs://B/run"],
    ["k8s", "--name", "gpt", "--image", "i:1", "--tier2", "az://x/run"],
], ids=["export-none", "export-some", "gs-bucket", "az-container"])
def test_what_would_not_reach_the_workers_is_refused(argv: list[str]) -> None:
    r = CliRunner().invoke(app, ["launch", *argv, "--", *TRAIN])
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert ("--export" in text and "credentials" in text) or "--tier2" in text, text


def test_export_all_with_more_is_accepted() -> None:
    assert "#SBATCH --export=ALL,EXTRA=1" in launch("slurm", "--sbatch=--export=ALL,EXTRA=1",
                                                    "--", *TRAIN)
