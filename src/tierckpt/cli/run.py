"""``tierckpt run``: start a training command on this node as torchrun would, and heal a
dead worker instead of restarting the job (:mod:`tierckpt.heal.launcher`; docs/heal.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from tierckpt.cli._app import command
from tierckpt.cli._extras import needs_torch
from tierckpt.cli._render import config_errors
from tierckpt.errors import ConfigError

# the multi-node options (docs/heal.md, "Across nodes")
_Nnodes = Annotated[str | None, typer.Option(
    help="MIN[:MAX] nodes: run this on every node; MIN run, the others wait as spare "
         "nodes that take a lost node's ranks. Needs --rdzv-endpoint and --rdzv-id.",
    show_default=False)]
_RdzvEndpoint = Annotated[str | None, typer.Option(
    help="The job's store across nodes: etcd://host:port[,host:port...].",
    show_default=False)]
_RdzvId = Annotated[str | None, typer.Option(
    help="The job's id in that store (fresh for every job).", show_default=False)]
_NodeId = Annotated[str | None, typer.Option(
    help="This node's name in the job (default: host name and pid).", show_default=False)]
_NodeTimeout = Annotated[float, typer.Option(
    help="Seconds without a node's heartbeat before it counts as lost.")]


@command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    command: Annotated[list[str] | None, typer.Argument(
        metavar="-- COMMAND", help="The training command: python train.py ARGS.",
        show_default=False)] = None,
    nproc_per_node: Annotated[str, typer.Option(
        help="Workers on this node: a number, or gpu (one per GPU torch sees).")] = "1",
    heal: Annotated[bool, typer.Option(
        "--heal/--no-heal", help="Replace a dead worker in place (default), or restart "
                                 "every worker as torchrun does.")] = True,
    max_heals: Annotated[int, typer.Option(help="Heals before a death means a full "
                                                "restart.")] = 100,
    max_restarts: Annotated[int, typer.Option(help="Full restarts before giving up.")] = 3,
    spares: Annotated[int, typer.Option(help="Pre-warmed replacements kept waiting "
                                             "(torch already imported).")] = 1,
    heal_timeout: Annotated[float, typer.Option(
        help="Seconds a heal may take before the launcher restarts everything.")] = 60.0,
    heal_stuck: Annotated[float, typer.Option(
        help="Seconds a surviving worker may take to leave the failed step before it is "
             "replaced too (blocked in a collective that no error reaches).")] = 10.0,
    port: Annotated[int, typer.Option(help="The job's store port (0: any free one).")] = 0,
    nnodes: _Nnodes = None, rdzv_endpoint: _RdzvEndpoint = None, rdzv_id: _RdzvId = None,
    node_id: _NodeId = None, node_timeout: _NodeTimeout = 3.0,
) -> None:
    """Run a training command on this node's workers and heal a dead one in place.

    Workers get torchrun's environment. When one dies, the others keep their processes and a
    pre-warmed replacement joins them; the job's CheckpointManager.heal() reloads the newest
    checkpoint in place on every rank. A death during a heal, or a heal that does not finish,
    restarts every worker as torchrun would. Exit status: the job's."""
    with needs_torch("run"):
        from tierckpt.heal.launcher import HealLaunch, HealLauncher
        from tierckpt.heal.nodes import NodeLaunch, NodeSupervisor, default_node_id
        from tierckpt.runtime.nodespec import parse_endpoint, parse_nnodes
    with config_errors():
        cfg = HealLaunch(nproc=_nproc(nproc_per_node), heal=heal, max_heals=max_heals,
                         max_restarts=max_restarts, spares=spares, timeout_s=heal_timeout,
                         stuck_s=heal_stuck, port=port)
        launcher: HealLauncher
        if nnodes is None:
            if rdzv_endpoint or rdzv_id or node_id:
                raise ConfigError("--rdzv-endpoint, --rdzv-id and --node-id are for a "
                                  "multi-node job: add --nnodes MIN[:MAX]")
            launcher = HealLauncher(list(command or []), cfg)
        else:
            if not rdzv_endpoint or not rdzv_id:
                raise ConfigError("--nnodes needs the job's store and id: add "
                                  "--rdzv-endpoint etcd://host:port --rdzv-id JOB")
            lo, hi = parse_nnodes(nnodes)
            launcher = NodeSupervisor(list(command or []), NodeLaunch(
                launch=cfg, min_nodes=lo, max_nodes=hi,
                endpoints=parse_endpoint(rdzv_endpoint), job=rdzv_id,
                node=node_id or default_node_id(), detect_s=node_timeout))
    raise typer.Exit(launcher.run())


def _nproc(text: str) -> int:
    """``--nproc-per-node``: a number, or ``gpu`` (one worker per CUDA device torch sees,
    as torchrun's ``gpu``)."""
    if text == "gpu":
        import torch

        if (n := torch.cuda.device_count()) < 1:
            raise ConfigError("--nproc-per-node gpu: torch sees no GPU on this node; give "
                              "the number of workers")
        return n
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--nproc-per-node {text!r}: give a number of workers, or gpu "
                          "(one per GPU)") from None
