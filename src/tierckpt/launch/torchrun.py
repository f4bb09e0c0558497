"""The torchrun job both launchers run, said once: :class:`TorchrunJob`, the options the
Slurm script and the Kubernetes manifests share (the training command, the notice lead,
nodes and spares, ranks per node, torchrun's restarts, the rendezvous port, the job's etcd,
what one node asks for), the check of what a node asks for, and the command each node runs
(:func:`node_command`): torchrun with its flags (:func:`torchrun_flags`), or with the
job's etcd ``tierckpt run``, which heals a lost node from a spare (:func:`heal_flags`).
Pure.

:class:`~tierckpt.launch.slurm.SlurmLaunch` and :class:`~tierckpt.launch.k8s.K8sLaunch`
extend it with their own fields and rules. Each checks its counts in its own words and
order (their messages differ: ``--nodes must be at least 1, got 0`` against one sentence
for all of Kubernetes' counts) and calls :meth:`TorchrunJob.check_node` where it always did.
"""

from __future__ import annotations

import dataclasses
import shlex

from tierckpt.errors import ConfigError
from tierckpt.launch.command import TrainCommand, shell_line
from tierckpt.launch.resources import check_counts, parse_memory
from tierckpt.launch.timing import Lead
from tierckpt.runtime.nodespec import parse_endpoint

__all__ = ["SIGNALS", "TorchrunJob", "heal_flags", "node_command", "torchrun_flags"]

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""torchrun's ``--signals-to-handle``: its default set plus SIGUSR1 (Slurm's lead)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchrunJob:
    """``command`` under torchrun on ``nodes`` nodes, ``spares`` more joining the
    rendezvous (``--nnodes nodes:nodes+spares``), ``nproc_per_node`` ranks each;
    ``max_restarts``: torchrun's restarts of a rank inside the allocation; ``lead``: the
    workers' grace after a notice (torchrun's ``--shutdown-timeout``). ``gpus_per_node``,
    ``cpus_per_node`` (0: not asked for) and ``memory`` (per node, e.g. ``512G``; None: not
    asked for): what each node asks its scheduler for, in
    :func:`~tierckpt.launch.resources.parse_memory`'s spelling."""

    command: TrainCommand
    lead: Lead
    nodes: int = 1
    spares: int = 0
    nproc_per_node: str = "gpu"
    max_restarts: int = 3
    port: int = 29500
    gpus_per_node: int = 0
    cpus_per_node: int = 0
    memory: str | None = None
    etcd: str | None = None

    def check_node(self) -> None:
        """ConfigError naming the flag unless the GPU and CPU counts are whole numbers
        >= 0, ``memory`` (when given) is a size, and with ``etcd`` the endpoint is an etcd
        URL and ``nproc_per_node`` a number or ``gpu`` (what ``tierckpt run`` takes)."""
        check_counts(gpus_per_node=self.gpus_per_node, cpus_per_node=self.cpus_per_node)
        if self.memory is not None:
            parse_memory(self.memory, "--memory")
        if self.etcd is not None:
            parse_endpoint(self.etcd, flag="--etcd")
            if self.nproc_per_node != "gpu" and not self.nproc_per_node.isdigit():
                raise ConfigError(f"--nproc-per-node {self.nproc_per_node!r} with --etcd: "
                                  "give a number of ranks per node, or gpu")

    @property
    def max_nodes(self) -> int:
        """The nodes in the rendezvous at most: ``nodes + spares``."""
        return self.nodes + self.spares

    @property
    def memory_mib(self) -> int:
        """``memory`` in MiB (0: not asked for)."""
        return parse_memory(self.memory, "--memory") if self.memory is not None else 0


def torchrun_flags(job: TorchrunJob, *, host: str, rdzv_id: str) -> list[str]:
    """torchrun's flags for ``job``, before the training command: c10d rendezvous on
    ``host`` (shell text inside double quotes, e.g. ``$head``) at ``job.port`` with id
    ``rdzv_id`` (the same, e.g. ``$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}``: a new id per
    restart of the whole job), restarts, the signals it passes on, and the lead as its
    shutdown timeout."""
    nnodes = f"{job.nodes}:{job.max_nodes}" if job.spares else str(job.nodes)
    return [
        f"--nnodes {nnodes}", f"--nproc-per-node {shlex.quote(job.nproc_per_node)}",
        "--rdzv-backend c10d", f'--rdzv-endpoint "{host}:{job.port}"',
        f'--rdzv-id "{rdzv_id}"',
        f"--max-restarts {job.max_restarts}", f"--signals-to-handle {SIGNALS}",
        f"--shutdown-timeout {job.lead.seconds}",
    ]


def heal_flags(job: TorchrunJob, *, rdzv_id: str, node_id: str) -> list[str]:
    """``tierckpt run``'s flags for ``job`` (which has ``etcd``), before ``--`` and the
    training command: its nodes and spare nodes, ranks per node, the job's etcd, the id
    of this run of the job (shell text inside double quotes, fresh per restart of the
    whole job, as torchrun's), this node's name (the same, e.g. ``$SLURMD_NODENAME``) and
    the full restarts. It forwards SIGTERM, SIGINT and SIGUSR1 to its workers and waits
    for them, so it needs no signal or shutdown flags."""
    nnodes = f"{job.nodes}:{job.max_nodes}" if job.spares else str(job.nodes)
    return [
        f"--nnodes {nnodes}", f"--nproc-per-node {shlex.quote(job.nproc_per_node)}",
        f"--rdzv-endpoint {shlex.quote(job.etcd or '')}", f'--rdzv-id "{rdzv_id}"',
        f'--node-id "{node_id}"', f"--max-restarts {job.max_restarts}",
    ]


def node_command(job: TorchrunJob, *, python: str, host: str, rdzv_id: str,
                 node_id: str) -> list[str]:
    """The command every node runs, as lines for the caller to join with `` \\`` line
    ends: ``python`` (shell text) running torchrun (rendezvous on ``host``) and then the
    training command as torchrun takes it; or with ``job.etcd`` running ``tierckpt run``
    (this node ``node_id``), ``--`` and the whole training command (``python`` runs a
    Python one). ``rdzv_id`` names this run of the job for either."""
    if job.etcd is None:
        return [f"{python} -m torch.distributed.run",
                *torchrun_flags(job, host=host, rdzv_id=rdzv_id),
                shell_line(job.command.argv)]
    argv = job.command.argv
    train = (shell_line(argv[1:]) if argv[0] == "--no-python"
             else f"{python} {shell_line(argv)}")
    return [f"{python} -m tierckpt run", *heal_flags(job, rdzv_id=rdzv_id, node_id=node_id),
            "--", train]
