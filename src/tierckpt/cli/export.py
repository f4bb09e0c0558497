"""``tierckpt export``: a consolidated, serving-ready copy of a checkpoint's model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from tierckpt.cli._app import command
from tierckpt.cli._extras import needs_torch
from tierckpt.cli._render import console, emit_json, transfer_bar
from tierckpt.cli._source import Tier1Option, Tier2Option, TierOption, parse_step, source_of
from tierckpt.cli._tiers import failures
from tierckpt.errors import ConfigError
from tierckpt.policy.units import format_bytes, parse_size

if TYPE_CHECKING:  # share.export imports torch: imported by the command when it runs
    from tierckpt.share.export import ExportSummary


@command()
def export(
    step: Annotated[str, typer.Argument(help="Step to export, or 'latest'.")],
    to: Annotated[Path, typer.Option("--to", help="Directory to create (must not exist).")],
    tier: TierOption = None,
    tier1: Tier1Option = None,
    tier2_url: Tier2Option = None,
    fmt: Annotated[str, typer.Option("--format", help="safetensors or torch.")
                   ] = "safetensors",
    key: Annotated[list[str] | None, typer.Option(
        "--keys", help="Top-level key(s) to export; repeatable.")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="Cast floating-point tensors: bf16, fp16 or fp32 (integers are kept).")] = None,
    max_shard_size: Annotated[str, typer.Option(
        help="Largest shard file, e.g. 5GB or 500MiB.")] = "5GB",
    strip_prefix: Annotated[str, typer.Option(
        help="Remove this prefix from names (after the key, e.g. 'module.').")] = "",
    add_prefix: Annotated[str, typer.Option(help="Put this prefix before names.")] = "",
    hf_config: Annotated[Path | None, typer.Option(
        help="A Hugging Face config.json to copy in (from_pretrained then loads the "
             "directory).")] = None,
    force: Annotated[bool, typer.Option(
        help="Replace an earlier export at --to (only once the new one is complete).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md); no progress bar.")] = False,
) -> None:
    """Write the model of a committed checkpoint as Hugging Face-style safetensors.

    From any world size: sharded safetensors with model.safetensors.index.json and
    SHA256SUMS, streamed (one tensor in memory at a time), every record checked against its
    CRC32C. Needs PyTorch."""
    with needs_torch("export"):
        from tierckpt.share.export import export as run_export
        from tierckpt.share.export import parse_dtype
    with failures():
        if fmt not in ("safetensors", "torch"):
            raise ConfigError(f"--format must be safetensors or torch, got {fmt!r}")
        source = source_of(tier, tier1, tier2_url)
        shard = parse_size(max_shard_size, "--max-shard-size")
        with transfer_bar("export", disable=as_json) as progress:
            summary = run_export(
                source, to, step=parse_step(step), keys=tuple(key or ("model",)),
                format=fmt,  # type: ignore[arg-type]
                dtype=parse_dtype(dtype), max_shard_bytes=shard, strip_prefix=strip_prefix,
                add_prefix=add_prefix, hf_config=hf_config, force=force,
                progress=progress)
    if as_json:
        emit_json(_summary_json(summary, fmt))
    else:
        _print_summary(summary)


def _summary_json(summary: ExportSummary, fmt: str) -> dict[str, Any]:
    """The ``--json`` document (schema in docs/cli.md)."""
    r = summary.result
    return {"step": summary.step, "source": summary.location,
            "to": str(summary.out_dir), "format": fmt, "tensors": r.tensors,
            "tensor_bytes": r.tensor_bytes, "bytes_read": summary.bytes_read,
            "peak_tensor_bytes": r.peak_tensor_bytes, "seconds": summary.seconds,
            "skipped": list(summary.skipped),
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256}
                      for f in r.files]}


def _print_summary(summary: ExportSummary) -> None:
    """One line for what was written, one for what was not (not tensors)."""
    r = summary.result
    out = console()
    out.print(f"[green]exported[/] step {summary.step} from {escape(summary.location)} to "
              f"{escape(str(summary.out_dir))}: {r.tensors} tensors, "
              f"{format_bytes(r.tensor_bytes)} in {len(r.files)} files "
              f"({summary.seconds:.1f} s, {format_bytes(summary.bytes_read)} read; checksums "
              "in SHA256SUMS)")
    if summary.skipped:
        out.print(f"[yellow]not exported[/] (not tensors): {', '.join(summary.skipped[:5])}")
