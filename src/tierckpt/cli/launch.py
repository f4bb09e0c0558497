"""``tierckpt launch``: write the sbatch script (``slurm``) or the Kubernetes manifest
(``k8s``) that runs a training command so that preemptions, time limits and cancels each
end the right way; and ``outcome``, the verdict those launchers ask for after the step.

The generators read the notice lead from the tier-1 root's events
(:mod:`tierckpt.launch.timing`) unless ``--lead`` is given, and print to stdout (or
``--out``). docs/schedulers.md is the recipe.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tierckpt.cli._app import app
from tierckpt.cli._render import config_errors
from tierckpt.launch import cluster, k8s, k8s_etcd, outcome, slurm, timing
from tierckpt.launch.command import split
from tierckpt.policy.units import parse_duration
from tierckpt.tier2.storage.url import FORMS

launch_app = typer.Typer(
    help="Write a Slurm batch script or a Kubernetes manifest that runs a training command "
         "so that a notice ends in an emergency save and a requeue.",
    no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(launch_app, name="launch")

Command = Annotated[list[str] | None, typer.Argument(
    help="The training command, after --: python train.py ARGS (without torchrun).",
    show_default=False)]
Tier1 = Annotated[Path | None, typer.Option(
    "--tier1", help="A tier-1 root whose events measure the emergency save (the lead).")]
Lead = Annotated[str | None, typer.Option(
    help="The notice to ask for (e.g. 90s), instead of the measured one.")]
ToTier = Annotated[str, typer.Option(
    "--to", help="The tier the emergency save must reach within the lead: tier1 or tier2.")]
Nodes = Annotated[int, typer.Option(help="Nodes that train.")]
Spares = Annotated[int, typer.Option(help="Extra nodes (--nnodes N:N+SPARES): they join "
                                          "torchrun's rendezvous, or with --etcd wait as "
                                          "spare nodes that take a lost node's ranks.")]
Etcd = Annotated[str | None, typer.Option(
    help="The job's etcd, etcd://host:port[,host:port]: every node runs tierckpt run, and "
         "a lost node is healed by a spare node while the others keep their processes "
         "(docs/heal.md).", show_default=False)]
Nproc = Annotated[str, typer.Option(help="torchrun --nproc-per-node (gpu, or a number).")]
MaxRestarts = Annotated[int, typer.Option(help="torchrun --max-restarts: ranks restarted "
                                               "inside the allocation.")]
Port = Annotated[int, typer.Option(help="The c10d rendezvous port on the first node.")]
Out = Annotated[Path | None, typer.Option(help="Write here instead of stdout.")]
Gpus = Annotated[int, typer.Option(help="GPUs per node (0: not asked for).")]
Cpus = Annotated[int, typer.Option(help="CPUs per node (0: not asked for).")]
Memory = Annotated[str | None, typer.Option(
    help="Memory per node, e.g. 512G (binary units: 1G = 1024M).")]


def given_argv(ctx: typer.Context, sub: str) -> list[str]:
    """The command line as given: ``tierckpt launch SUB``, every option set on the command
    line (``--flag=value``, in the command's order; defaults left out), ``--``, the
    training command. Running it again writes the same script (the lead re-measured where
    ``--tier1`` gives it and ``--lead`` does not)."""
    argv, command = ["tierckpt", "launch", sub], list[str]()
    for param in ctx.command.params:
        name = param.name or ""
        source = ctx.get_parameter_source(name)
        if source is None or source.name != "COMMANDLINE":  # typer's click or click's
            continue
        value = ctx.params[name]
        if param.param_type_name == "argument":
            command = [str(v) for v in value or ()]
            continue
        flag = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            argv += [flag] if value else (param.secondary_opts[:1] or [])
            continue
        argv += [f"{flag}={v}" for v in (value if isinstance(value, list | tuple) else [value])]
    return [*argv, "--", *command]


def _lead(tier1: Path | None, lead: str | None, to: str) -> timing.Lead:
    save = timing.save_time(timing.read_root(tier1), to=to) if tier1 is not None else None
    given = parse_duration(lead, "--lead") if lead is not None else None
    return timing.lead(save, given_s=given)


def _write(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        if text.startswith("#!"):
            out.chmod(0o755)


@launch_app.command("slurm")
def launch_slurm(
    ctx: typer.Context,
    command: Command = None,
    tier1: Tier1 = None, lead: Lead = None, to: ToTier = "tier1", nodes: Nodes = 1,
    spares: Spares = 0, nproc_per_node: Nproc = "gpu", max_restarts: MaxRestarts = 3,
    etcd: Etcd = None,
    max_requeues: Annotated[int, typer.Option(
        help="Requeue after an emergency save at most this many times.")] = 5,
    port: Port = 29500,
    job_name: Annotated[str, typer.Option(help="#SBATCH --job-name.")] = "tierckpt",
    tier0: Annotated[str | None, typer.Option(help="Default TIERCKPT_TIER0.")] = None,
    tier2: Annotated[str | None, typer.Option(
        help=f"Default TIERCKPT_TIER2: {FORMS}.")] = None,
    sbatch: Annotated[list[str] | None, typer.Option(
        help="An extra #SBATCH option, e.g. --sbatch=--time=04:00:00 (repeatable).")] = None,
    gpus_per_node: Gpus = 0, cpus_per_node: Cpus = 0, memory: Memory = None,
    out: Out = None,
) -> None:
    """Write an sbatch script: --requeue, --signal=B:USR1@LEAD from the measured emergency
    save, srun + torchrun per node, and a requeue only after an announced interruption that
    saved.

    --tier1 is also the default of TIERCKPT_TIER1 in the script; tier paths and tier-2
    credentials otherwise come from the submitter's environment (AWS_* for s3://,
    GOOGLE_APPLICATION_CREDENTIALS or STORAGE_EMULATOR_HOST for gs://, AZURE_STORAGE_* for
    az://). torchrun and every
    tierckpt call run under $TIERCKPT_PYTHON: the command's interpreter if it is an
    absolute path, else the one running this."""
    with config_errors():
        job = slurm.SlurmLaunch(
            command=split(command or [], launcher="launch slurm"),
            lead=_lead(tier1, lead, to), nodes=nodes, spares=spares,
            nproc_per_node=nproc_per_node, max_restarts=max_restarts,
            max_requeues=max_requeues, port=port, job_name=job_name, etcd=etcd,
            tier1=str(tier1) if tier1 else None, tier0=tier0, tier2=tier2,
            sbatch=tuple(sbatch or ()), gpus_per_node=gpus_per_node,
            cpus_per_node=cpus_per_node, memory=memory)
        _write(slurm.sbatch_script(job, given_argv(ctx, "slurm")), out)


@launch_app.command("k8s")
def launch_k8s(
    command: Command = None,
    name: Annotated[str, typer.Option(help="The JobSet's name (a DNS label); required.")] = "",
    image: Annotated[str, typer.Option(
        help="The container image with the training code; required.")] = "",
    tier1: Tier1 = None, lead: Lead = None, to: ToTier = "tier1", nodes: Nodes = 1,
    spares: Spares = 0, nproc_per_node: Nproc = "gpu", etcd: Etcd = None,
    gpus_per_node: Annotated[int, typer.Option(help="nvidia.com/gpu per pod.")] = 0,
    cpus_per_node: Annotated[int, typer.Option(help="CPUs requested per pod.")] = 0,
    memory: Annotated[str | None, typer.Option(
        help="Memory per pod for the training, e.g. 512Gi (the limit adds --tier0-size).")
    ] = None,
    max_restarts: MaxRestarts = 3,
    max_failures: Annotated[int, typer.Option(
        help="JobSet restarts after failures (preemptions do not count).")] = 3,
    port: Port = 29500,
    tier0_size: Annotated[str | None, typer.Option(
        help="Tier 0: an emptyDir in RAM of this sizeLimit (e.g. 64Gi) at TIERCKPT_TIER0, "
             "where Tier0() keeps its root.")] = None,
    tier1_host_path: Annotated[str | None, typer.Option(
        help="Tier 1: this node-local path (hostPath); default --tier1, else "
             "/mnt/tierckpt/NAME.")] = None,
    tier1_claim: Annotated[str | None, typer.Option(
        help="Tier 1: this PersistentVolumeClaim instead.")] = None,
    tier2: Annotated[str | None, typer.Option(help=f"TIERCKPT_TIER2: {FORMS}.")] = None,
    tier2_secret: Annotated[str | None, typer.Option(
        help="A Secret holding tier 2's credentials, for any store (AWS_ACCESS_KEY_ID, "
             "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_CONNECTION_STRING, ...): "
             "environment variables, and files under /tierckpt/tier2-secret (a key "
             "file).")] = None,
    trainjob: Annotated[bool, typer.Option(
        "--trainjob", help="Also write a Kubeflow TrainJob.")] = False,
    etcd_members: Annotated[int, typer.Option(
        help="Start the job's own etcd of this many members (1, 3, 5 or 7; 3 survives a "
             "lost node): a StatefulSet beside the JobSet, instead of --etcd.")] = 0,
    etcd_image: Annotated[str | None, typer.Option(
        help="The etcd image (3.4 or later) for --etcd-members.")] = None,
    out: Out = None,
) -> None:
    """Write a JobSet (and with --trainjob a Kubeflow TrainJob): grace from the measured
    emergency save, c10d rendezvous over the headless service, restart on exit 75, fail on
    exit 2.

    Tier 0 is an emptyDir in RAM, tier 1 a node-local volume of this job's own (--tier1,
    else /mnt/tierckpt/NAME), tier-2 credentials a Secret; each pod on its own node."""
    with config_errors():
        job = k8s.K8sLaunch(
            name=name, image=image, command=split(command or [], launcher="launch k8s"),
            lead=_lead(tier1, lead, to), nodes=nodes, spares=spares,
            nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node,
            cpus_per_node=cpus_per_node, memory=memory, max_restarts=max_restarts,
            max_failures=max_failures, port=port, etcd=etcd, tier0_size=tier0_size,
            tier1_host_path=tier1_host_path or (str(tier1) if tier1 else None),
            tier1_claim=tier1_claim, tier2=tier2, tier2_secret=tier2_secret,
            etcd_members=etcd_members, etcd_image=etcd_image)
        docs = [*k8s_etcd.manifests(job), k8s.jobset(job),
                *([k8s.trainjob(job)] if trainjob else [])]
        _write(k8s.to_yaml(docs), out)


@launch_app.command("wait-etcd")
def launch_wait_etcd(
    etcd: Annotated[str, typer.Option(help="The job's etcd, etcd://host:port[,host:port].")],
    within: Annotated[float, typer.Option(help="Seconds to wait at most.")] = 300.0,
) -> None:
    """Wait until a majority of the job's etcd members answer healthy (the generated k8s
    launcher runs it before the training starts); exit 1 with what they answered if they
    do not within --within seconds, 2 on a bad endpoint."""
    with config_errors():
        ok, line = cluster.wait_etcd(etcd, within_s=within, say=lambda s: print(
            f"tierckpt launch wait-etcd: {s}", file=sys.stderr, flush=True))
    if not ok:
        print(f"tierckpt launch wait-etcd: not answering after {within:g} s: {line}",
              file=sys.stderr)
        raise typer.Exit(1)


@launch_app.command("outcome")
def launch_outcome(
    tier1: Annotated[Path, typer.Option("--tier1", help="The job's tier-1 root.")],
    since: Annotated[float, typer.Option(help="When the step started (Unix seconds).")],
    rc: Annotated[int, typer.Option(help="The step's exit status.")],
    notices: Annotated[str, typer.Option(
        help="What the launcher's shell received: words usr1, term.")] = "",
    slurm_job: Annotated[str | None, typer.Option(
        help="The Slurm job id: read its state with scontrol.")] = None,
    max_requeues: Annotated[int | None, typer.Option(
        help="Under Slurm: run again at most this many times.")] = None,
) -> None:
    """After a launcher's step: print again, requeued or stop, say why on stderr, exit 75
    when the job should run again (preempted, emergency save committed), else the step's
    status. "requeued": under Slurm the job already asked for its requeue itself, after its
    emergency save; do not requeue again.

    The generated scripts call it; a hand-written sbatch script can too (docs/schedulers.md).
    Exit 2 on a configuration error."""
    with config_errors():
        facts = outcome.read_slurm_job(slurm_job) if slurm_job else None
        records = timing.read_root(tier1)
        saved = outcome.emergency_save(records, since)
        verdict = outcome.decide(rc=rc, notices=notices.split(), saved=saved, slurm=facts,
                                 max_requeues=max_requeues,
                                 done=outcome.finished(records, since),
                                 requeued=outcome.requeued_by_job(records, since))
    print(f"tierckpt launch outcome: {verdict.why}", file=sys.stderr)
    print("again" if verdict.again else "requeued" if verdict.requeued else "stop")
    raise typer.Exit(verdict.code)
