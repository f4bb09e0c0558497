"""``tierckpt launch slurm`` and ``launch k8s``: what they write, checked by the real
parsers — bash (``bash -n``), Slurm (``sbatch --test-only`` on the test cluster),
Kubernetes' schemas (kubernetes-validate, strict) and the JobSet/TrainJob API models
(kubeflow-trainer-api) — and the lead they derive from a run's events."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tierckpt.cli._app import app
from tierckpt.cli.launch import launch_app  # noqa: F401  (registers `launch`)
from tierckpt.launch import k8s, timing
from tierckpt.launch.command import split
from tierckpt.runtime import events as ev

from ._cluster import SlurmCluster

RUNNER = CliRunner()
TRAIN = ["python", "train.py", "--tier1", "$TIERCKPT_TIER1", "--steps", "1000"]


def launch(*args: str) -> str:
    r = RUNNER.invoke(app, ["launch", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def lead_events(path: Path, seconds: float) -> Path:
    """A tier-1 root whose events hold two emergency saves, the slowest ``seconds``."""
    path.mkdir(parents=True, exist_ok=True)
    with ev.EventLog(path / "events.jsonl") as log:
        log.emit(ev.PREEMPT_SAVED, step=10, reached=["tier1"], seconds=seconds / 2)
        log.emit(ev.PREEMPT_SAVED, step=20, reached=["tier1"], seconds=seconds)
    return path


# --- Slurm -------------------------------------------------------------------------------

def test_the_sbatch_script_parses_and_has_the_flags(tmp_path: Path) -> None:
    root = lead_events(tmp_path / "t1", 40.0)
    text = launch("slurm", "--tier1", str(root), "--nodes", "2", "--spares", "1",
                  "--nproc-per-node", "4", "--sbatch=--time=04:00:00", "--", *TRAIN)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lead = 63  # 1.5 x (40 s + 2 s margin)
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append",
                 f"#SBATCH --signal=B:USR1@{lead}", "#SBATCH --nodes=2-3",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --time=04:00:00",
                 "#SBATCH --no-kill"):
        assert line + "\n" in text, line
    for flag in ("--nnodes 2:3", "--nproc-per-node 4", "--rdzv-backend c10d",
                 '--rdzv-endpoint "$head:29500"', "--max-restarts 3",
                 "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                 f"--shutdown-timeout {lead}", 'train.py --tier1 "$TIERCKPT_TIER1"',
                 'scontrol requeue "$SLURM_JOB_ID"', "export TIERCKPT_MAX_REQUEUES=5",
                 '--max-requeues "$TIERCKPT_MAX_REQUEUES"'):
        assert flag in text, flag
    assert f'TIERCKPT_TIER1="${{TIERCKPT_TIER1:-{root}}}"' in text
    assert "the slowest of 2 emergency saves" in text


def test_the_header_writes_the_same_script_again(tmp_path: Path) -> None:
    """The header's command line, run again, writes the script again, byte for byte."""
    argv = ["slurm", "--tier1", str(tmp_path / "t1"), "--nodes", "2", "--lead", "45s",
            "--gpus-per-node", "4", "--cpus-per-node", "16", "--memory", "256G",
            "--sbatch=--time=04:00:00", "--sbatch", "--partition=gpu", "--job-name", "gpt",
            "--", *TRAIN, "--note", "two words"]
    text = launch(*argv)
    [line] = [x for x in text.splitlines() if x.startswith("#   tierckpt launch slurm")]
    again = shlex.split(line.removeprefix("#   "))
    assert again[:2] == ["tierckpt", "launch"] and "--lead=45s" in again
    assert launch(*again[2:]) == text
    for want in ("#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --mem=256G"):
        assert want + "\n" in text, want


def test_torchrun_runs_under_the_interpreter_of_every_tierckpt_call() -> None:
    """Never ``python`` from the node's PATH: torchrun runs under ``$TIERCKPT_PYTHON``, the
    interpreter the tierckpt calls use: the command's own when it is an absolute path,
    else the one that wrote the script."""
    text = launch("slurm", "--", *TRAIN)
    assert '"$TIERCKPT_PYTHON" -m torch.distributed.run' in text
    assert "python -m torch.distributed.run" not in text.replace('PYTHON" -m', "")
    assert f'TIERCKPT_PYTHON="${{TIERCKPT_PYTHON:-{sys.executable}}}"' in text
    own = launch("slurm", "--", "/opt/venv/bin/python3", "train.py")
    assert 'TIERCKPT_PYTHON="${TIERCKPT_PYTHON:-/opt/venv/bin/python3}"' in own
    assert '[ -x "$TIERCKPT_PYTHON" ] || fail' in own


@pytest.mark.parametrize("sub", ["slurm", "k8s"])
def test_a_missing_command_names_its_own_subcommand(sub: str) -> None:
    r = RUNNER.invoke(app, ["launch", sub, "--name", "x", "--image", "i"] if sub == "k8s"
                      else ["launch", sub])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and f"tierckpt launch {sub} -- python train.py" in text, text


def test_each_k8s_job_has_its_own_tier1_by_default() -> None:
    """Two jobs of different names on one node never share a tier-1 directory."""
    paths = []
    for name in ("gpt", "bert"):
        (js,) = yaml.safe_load_all(launch("k8s", "--name", name, "--image", "i", "--",
                                          *TRAIN))
        pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        paths.append({v["name"]: v for v in pod["volumes"]}["tier1"]["hostPath"]["path"])
    assert paths == ["/mnt/tierckpt/gpt", "/mnt/tierckpt/bert"]
    (js,) = yaml.safe_load_all(launch("k8s", "--name", "gpt", "--image", "i",
                                      "--tier1-host-path", "/data/ckpt", "--", *TRAIN))
    assert "/data/ckpt" in json.dumps(js)


@pytest.mark.parametrize(("argv", "what"), [
    (["slurm", "--memory", "1.5T"], "--memory '1.5T': give a size with a binary unit"),
    (["slurm", "--gpus-per-node", "2", "--sbatch=--gpus-per-node=3"], "give one"),
    (["k8s", "--name", "x", "--image", "i", "--tier0-size", "8GB!"], "--tier0-size"),
    (["k8s", "--name", "x", "--image", "i", "--tier1-host-path", "rel"], "absolute path"),
])
def test_bad_resources_say_what_to_fix(argv: list[str], what: str) -> None:
    r = RUNNER.invoke(app, ["launch", *argv, "--", *TRAIN])
    assert r.exit_code == 2 and what in " ".join(r.output.split()), r.output


def test_without_events_the_lead_is_the_default_or_given(tmp_path: Path) -> None:
    assert f"--signal=B:USR1@{timing.DEFAULT_LEAD_S}" in launch("slurm", "--", *TRAIN)
    assert "--signal=B:USR1@90\n" in launch("slurm", "--lead", "90s", "--", *TRAIN)


@pytest.mark.parametrize(("argv", "what"), [
    ([], "no training command"),
    (["torchrun", "train.py"], "without torchrun"),
    (["--sbatch=--signal=USR2@10", "--", *TRAIN], "sets --signal itself"),
    (["--nodes", "0", "--", *TRAIN], "--nodes must be at least 1"),
])
def test_bad_settings_say_what_to_fix(argv: list[str], what: str) -> None:
    if argv and argv[0] == "torchrun":
        argv = ["--", *argv]
    r = RUNNER.invoke(app, ["launch", "slurm", *argv])
    assert r.exit_code == 2 and what in " ".join(r.output.split()), r.output


def test_commands_split_for_torchrun() -> None:
    assert split(["python3", "-m", "pkg.train", "x"]).argv == ("-m", "pkg.train", "x")
    assert split(["train.py", "a b"]).argv == ("train.py", "a b")
    assert split(["./trainer", "--x"]).argv == ("--no-python", "./trainer", "--x")


@pytest.mark.slow
def test_sbatch_accepts_the_script(slurm: SlurmCluster, tmp_path: Path) -> None:
    text = launch("slurm", "--tier1", str(tmp_path / "t1"), "--nproc-per-node", "2",
                  "--sbatch=--cpus-per-task=2", "--", *TRAIN)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    p = slurm.run("sbatch", "--test-only", str(script), check=False)
    assert p.returncode == 0 and "to start at" in p.stderr, p.stderr


# --- Kubernetes --------------------------------------------------------------------------

def _unknown_keys(model: Any, doc: Any, where: str = "") -> list[str]:
    """Keys of ``doc`` the pydantic API ``model`` does not define, recursively (the models
    ignore unknown keys; the API server would reject them)."""
    origin = typing.get_origin(model)
    if origin is typing.Annotated:
        return _unknown_keys(typing.get_args(model)[0], doc, where)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(model) if a is not type(None)]
        return _unknown_keys(args[0], doc, where) if len(args) == 1 else []
    if origin is list and isinstance(doc, list):
        (item,) = typing.get_args(model)
        return [u for i, d in enumerate(doc) for u in _unknown_keys(item, d, f"{where}[{i}]")]
    if isinstance(model, type) and hasattr(model, "model_fields") and isinstance(doc, dict):
        fields = {(f.alias or n): f.annotation for n, f in model.model_fields.items()}
        out = [f"{where}.{k}" for k in doc if k not in fields]
        for k, v in doc.items():
            if k in fields:
                out += _unknown_keys(fields[k], v, f"{where}.{k}")
        return out
    return []


def _model_errors(model: Any, doc: dict[str, Any]) -> list[str]:
    """``model.model_validate(doc)``'s errors, less one artefact of the generated models:
    they type a resource Quantity as an object, where the API takes ``"64Gi"`` or ``8``."""
    from pydantic import ValidationError

    try:
        model.model_validate(doc)
    except ValidationError as e:
        return [f"{e_['loc']}: {e_['msg']}" for e_ in e.errors()
                if not ("Quantity" in e_["msg"] and isinstance(e_["input"], str | int))]
    return []


@pytest.fixture
def manifests(tmp_path: Path) -> list[dict[str, Any]]:
    root = lead_events(tmp_path / "t1", 40.0)
    text = launch("k8s", "--name", "gpt", "--image", "registry.local/gpt:1", "--tier1",
                  str(root), "--nodes", "2", "--spares", "1", "--nproc-per-node", "8",
                  "--gpus-per-node", "8", "--cpus-per-node", "32", "--memory", "512Gi",
                  "--tier0-size", "64Gi", "--tier2", "s3://b/p",
                  "--tier2-secret", "tier2-creds", "--trainjob", "--", *TRAIN)
    return list(yaml.safe_load_all(text))


def test_the_jobset_is_a_valid_jobset(manifests: list[dict[str, Any]]) -> None:
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    js = manifests[0]
    assert js["kind"] == "JobSet"
    assert _model_errors(JobsetV1alpha2JobSet, js) == []
    assert _unknown_keys(JobsetV1alpha2JobSet, js) == []


def test_the_jobs_pods_are_valid_kubernetes(manifests: list[dict[str, Any]]) -> None:
    import kubernetes_validate as kv  # a dev dependency: missing is a failure, never a skip
    spec = manifests[0]["spec"]["replicatedJobs"][0]["template"]["spec"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "gpt-node-0"},
           "spec": spec}
    kv.validate(job, "1.33", strict=True)


def test_the_jobset_carries_grace_rendezvous_policy_and_tiers(
        manifests: list[dict[str, Any]], tmp_path: Path) -> None:
    js = manifests[0]["spec"]
    job = js["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["terminationGracePeriodSeconds"] == 63 + timing.TEARDOWN_S
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    assert job["parallelism"] == job["completions"] == 3
    script = c["command"][2]
    assert '--rdzv-endpoint "gpt-node-0-0.gpt:29500"' in script
    assert "--nnodes 2:3" in script and "--shutdown-timeout 63" in script
    assert "SIGUSR1" in script and "trap" in script
    assert js["network"]["subdomain"] == "gpt"
    codes = {r["onExitCodes"]["values"][0]: r["action"]
             for r in job["podFailurePolicy"]["rules"]}
    assert codes == {75: "FailJob", 2: "FailJob"}
    rules = {r["name"]: r for r in js["failurePolicy"]["rules"]}
    assert rules["preempted-and-saved"]["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert rules["configuration-error"]["action"] == "FailJobSet"
    assert "exit code 75" in rules["preempted-and-saved"]["onJobFailureMessagePatterns"][0]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["tier0"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert vols["tier1"]["hostPath"]["path"] == str(tmp_path / "t1")  # --tier1's
    assert c["envFrom"] == [{"secretRef": {"name": "tier2-creds"}}]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TIERCKPT_TIER0"] == k8s.TIER0_MOUNT and env["TIERCKPT_TIER2"] == "s3://b/p"
    assert env["TIERCKPT_GRACE_S"] == "63"  # the workers' window: torchrun's shutdown timeout
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]
              if "valueFrom" in e}
    assert fields == {"RESTART_ATTEMPT": f"metadata.annotations['{k8s.RESTART_ATTEMPT}']",
                      "TIERCKPT_JOB_ID": f"metadata.labels['{k8s.JOBSET_NAME}']",
                      "POD_NAME": "metadata.name"}
    # GPUs asked and capped; CPUs asked; memory for the training plus tier 0's RAM volume
    # (a memory-backed emptyDir is charged to the container)
    assert c["resources"] == {
        "requests": {"nvidia.com/gpu": 8, "cpu": 32, "memory": "576Gi"},
        "limits": {"nvidia.com/gpu": 8, "memory": "576Gi"}}
    [term] = pod["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"labelSelector": {"matchLabels": {k8s.JOBSET_NAME: "gpt"}},
                    "topologyKey": "kubernetes.io/hostname"}  # one pod of the job per node
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


def test_the_trainjob_is_a_valid_trainjob(manifests: list[dict[str, Any]]) -> None:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    tj = manifests[1]
    assert tj["kind"] == "TrainJob"
    assert _model_errors(TrainerV1alpha1TrainJob, tj) == []
    assert _unknown_keys(TrainerV1alpha1TrainJob, tj) == []
    patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 63 + timing.TEARDOWN_S
    assert '"$PET_MASTER_ADDR:29500"' in tj["spec"]["trainer"]["command"][2]


def test_the_cli_writes_no_torch(tmp_path: Path) -> None:
    """The launch commands run without importing torch (they run on login nodes)."""
    code = ("import sys; from tierckpt.cli import main; sys.argv = ['tierckpt', 'launch', "
            "'slurm', '--', 'python', 'train.py']\ntry: main()\nexcept SystemExit: pass\n"
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "#SBATCH --requeue" in p.stdout, p.stderr


def test_yaml_round_trips(manifests: list[dict[str, Any]]) -> None:
    again = list(yaml.safe_load_all(k8s.to_yaml(manifests)))
    assert json.dumps(again, sort_keys=True) == json.dumps(manifests, sort_keys=True)
