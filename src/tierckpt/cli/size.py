"""``tierckpt size``: how big a checkpoint is, per node and per rank, whether staging fits in
host RAM, and how long a node takes to write its share."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from tierckpt.cli._app import command
from tierckpt.cli._render import config_errors, console, emit_json
from tierckpt.errors import ConfigError
from tierckpt.policy import plan
from tierckpt.policy.units import format_bytes, parse_count, parse_size

DEFAULT_RESERVE_FRACTION = 0.25
"""Host RAM kept for data loaders and everything else when --reserve is not given."""
GIVEN_OR_DEFAULT = {True: "given", False: f"default {DEFAULT_RESERVE_FRACTION:.0%} of node RAM"}


@command()
def size(
    params: Annotated[str, typer.Option(help="Parameter count: 70e9, 70B, 8B, 1.5T.")],
    optimizer: Annotated[str, typer.Option(
        help="adam | adamw (2 fp32 moments) | sgd-momentum (1) | sgd (0).")] = "adam",
    weights: Annotated[str, typer.Option(help="Weight dtype: bf16 | fp16 | fp32.")] = "bf16",
    master_fp32: Annotated[bool, typer.Option(
        "--master-fp32/--no-master-fp32",
        help="An fp32 master copy beside bf16/fp16 weights (ignored for fp32).")] = True,
    nodes: Annotated[int, typer.Option(help="Nodes sharing the checkpoint.")] = 1,
    gpus_per_node: Annotated[int, typer.Option(help="Ranks per node.")] = 8,
    extra: Annotated[str, typer.Option(
        help="Other state in the checkpoint (data loader, RNG): 2GiB.")] = "0",
    node_ram: Annotated[str | None, typer.Option(help="Host RAM per node: 2TiB.")] = None,
    reserve: Annotated[str | None, typer.Option(
        help="Host RAM per node kept for data loaders etc. (default: 25% of --node-ram)")] = None,
    node_write_gbps: Annotated[float | None, typer.Option(
        help="Per-node write bandwidth in GB/s (10^9 bytes/s) for the write time.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/planning.md).")] = False,
) -> None:
    """Checkpoint size: bytes per parameter, total, per node and rank, RAM fit, write time."""
    with config_errors():
        doc = size_report(params=params, optimizer=optimizer, weights=weights,
                          master_fp32=master_fp32, nodes=nodes, gpus_per_node=gpus_per_node,
                          extra=extra, node_ram=node_ram, reserve=reserve,
                          node_write_gbps=node_write_gbps)
    if as_json:
        emit_json(doc)
    else:
        _render(doc)


def size_report(*, params: str, optimizer: str, weights: str, master_fp32: bool, nodes: int,
                gpus_per_node: int, extra: str, node_ram: str | None, reserve: str | None,
                node_write_gbps: float | None) -> dict[str, Any]:
    """The ``--json`` document for the given flags (ConfigError names the bad flag)."""
    for flag, n in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if n < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {n}")
    if reserve is not None and node_ram is None:
        raise ConfigError("--reserve needs --node-ram")
    try:
        sz = plan.checkpoint_size(
            parse_count(params, "--params"), optimizer=optimizer, weights=weights,
            master_fp32=master_fp32, extra_bytes=parse_size(extra, "--extra", allow_zero=True),
            nodes=nodes, gpus_per_node=gpus_per_node)
    except ConfigError as e:  # name the flag: the library says "optimizer: ..."
        raise ConfigError(f"--{e}") from None
    doc: dict[str, Any] = {
        "params": sz.params,
        "bytes_per_param": sz.per_param.total,
        "bytes_per_param_parts": {"weights": sz.per_param.weights,
                                  "master": sz.per_param.master,
                                  "optimizer": sz.per_param.optimizer},
        "extra_bytes": sz.extra_bytes,
        "total_bytes": sz.total_bytes,
        "nodes": sz.nodes,
        "gpus_per_node": sz.gpus_per_node,
        "per_node_bytes": sz.per_node_bytes,
        "per_rank_bytes": sz.per_rank_bytes,
        "ram": None,
        "write": None,
    }
    if node_ram is not None:
        ram = parse_size(node_ram, "--node-ram")
        res = (parse_size(reserve, "--reserve", allow_zero=True) if reserve is not None
               else round(ram * DEFAULT_RESERVE_FRACTION))
        fit = plan.staging_fit(sz.per_node_bytes, ram, res)
        doc["ram"] = {"node_ram_bytes": fit.node_ram_bytes, "reserve_bytes": fit.reserve_bytes,
                      "reserve_source": GIVEN_OR_DEFAULT[reserve is not None],
                      "staging_bytes": fit.staging_bytes, "margin_bytes": fit.margin_bytes,
                      "fits": fit.fits}
    if node_write_gbps is not None:
        if not node_write_gbps > 0:
            raise ConfigError(f"--node-write-gbps must be > 0, got {node_write_gbps}")
        bps = node_write_gbps * 1e9
        doc["write"] = {"node_write_bytes_per_s": bps,
                        "write_s": plan.write_time(sz.per_node_bytes, bps)}
    return doc


def _render(doc: dict[str, Any]) -> None:
    out = console()
    parts = doc["bytes_per_param_parts"]
    t = Table(title=f"Checkpoint of {doc['params']:,} parameters")
    t.add_column("part")
    t.add_column("bytes/param", justify="right")
    t.add_column("total", justify="right")
    for name, label in (("weights", "weights"), ("master", "fp32 master"),
                        ("optimizer", "optimizer moments")):
        t.add_row(label, str(parts[name]), format_bytes(parts[name] * doc["params"]))
    if doc["extra_bytes"]:
        t.add_row("extra state", "", format_bytes(doc["extra_bytes"]))
    t.add_row("[bold]total[/]", f"[bold]{doc['bytes_per_param']}[/]",
              f"[bold]{format_bytes(doc['total_bytes'])}[/]")
    out.print(t)
    out.print(f"per node ({doc['nodes']} nodes): {format_bytes(doc['per_node_bytes'])}   "
              f"per rank ({doc['gpus_per_node']}/node): {format_bytes(doc['per_rank_bytes'])}")
    ram = doc["ram"]
    if ram is not None:
        verdict = "[green]fits[/]" if ram["fits"] else "[red]does NOT fit[/]"
        out.print(f"pinned staging {format_bytes(ram['staging_bytes'])} + reserve "
                  f"{format_bytes(ram['reserve_bytes'])} ({ram['reserve_source']}) in "
                  f"{format_bytes(ram['node_ram_bytes'])} RAM: {verdict}, margin "
                  f"{format_bytes(ram['margin_bytes'])}")
    w = doc["write"]
    if w is not None:
        out.print(f"write time per node at {w['node_write_bytes_per_s'] / 1e9:g} GB/s: "
                  f"{w['write_s']:.1f} s")
