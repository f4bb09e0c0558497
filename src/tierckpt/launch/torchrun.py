"""The torchrun job both launchers run, said once: :class:`TorchrunJob`, the options the
Slurm script and the Kubernetes manifests share (the training command, the notice lead,
nodes and spares, ranks per node, torchrun's restarts, the rendezvous port, what one node
asks for), the check of what a node asks for, and torchrun's flags (:func:`torchrun_flags`).
Pure.

:class:`~tierckpt.launch.slurm.SlurmLaunch` and :class:`~tierckpt.launch.k8s.K8sLaunch`
extend it with their own fields and rules. Each checks its counts in its own words and
order (their messages differ: ``--nodes must be at least 1, got 0`` against one sentence
for all of Kubernetes' counts) and calls :meth:`TorchrunJob.check_node` where it always did.
"""

from __future__ import annotations

import dataclasses
import shlex

from tierckpt.launch.command import TrainCommand
from tierckpt.launch.resources import check_counts, parse_memory
from tierckpt.launch.timing import Lead

__all__ = ["SIGNALS", "TorchrunJob", "torchrun_flags"]

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

    def check_node(self) -> None:
        """ConfigError naming the flag unless the GPU and CPU counts are whole numbers
        >= 0 and ``memory`` (when given) is a size."""
        check_counts(gpus_per_node=self.gpus_per_node, cpus_per_node=self.cpus_per_node)
        if self.memory is not None:
            parse_memory(self.memory, "--memory")

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
