"""Shared rendering for the planning commands: errors in red with exit status 2, JSON on
stdout, percentages, and waste-vs-interval plots (matplotlib, imported only when plotting)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from tierckpt.errors import ConfigError

EXIT_CONFIG = 2
"""Exit status for bad input (ConfigError), as for a usage error."""


def console() -> Console:
    """A console on the current stdout (created per call so test runners capture it)."""
    return Console(highlight=False)


@contextmanager
def config_errors() -> Iterator[None]:
    """Turn a ConfigError into a red ``error:`` line on stderr and exit status 2."""
    try:
        yield
    except ConfigError as e:
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] [red]{escape(str(e))}[/]")
        raise typer.Exit(EXIT_CONFIG) from None


def emit_json(doc: Any) -> None:
    """Print ``doc`` as indented JSON on stdout (plain text: no rich markup or wrapping)."""
    typer.echo(json.dumps(doc, indent=2, sort_keys=False, allow_nan=False))


def pct(x: float) -> str:
    """``0.0735`` → ``"7.35 %"``."""
    return f"{100.0 * x:.2f} %" if math.isfinite(x) else str(x)


@dataclass
class Curve:
    """One line on a waste plot (seconds and fractions), with an optional marked optimum."""

    label: str
    taus: Sequence[float]
    waste: Sequence[float]
    style: str = "-"
    optimum: tuple[float, float] | None = None


@dataclass
class Points:
    """Simulated points with confidence intervals."""

    label: str
    taus: Sequence[float]
    waste: Sequence[float]
    low: Sequence[float]
    high: Sequence[float]
    best: tuple[float, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def plot_waste(path: str | Path, curves: Sequence[Curve], points: Sequence[Points] = (),
               *, title: str = "Waste vs checkpoint interval") -> Path:
    """Draw waste (%) against the interval (minutes, log scale) to ``path`` (PNG by suffix)
    and return the path. Raises ConfigError naming ``--plot`` if matplotlib is missing or the
    file cannot be written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: install tierckpt[plot]") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for c in curves:
            line = ax.plot([t / 60 for t in c.taus], [100 * w for w in c.waste], c.style,
                           label=c.label)[0]
            if c.optimum is not None:
                ax.plot(c.optimum[0] / 60, 100 * c.optimum[1], "o", color=line.get_color())
                ax.annotate(f"{c.optimum[0] / 60:.1f} min, {100 * c.optimum[1]:.2f} %",
                            (c.optimum[0] / 60, 100 * c.optimum[1]), textcoords="offset points",
                            xytext=(5, 8), fontsize=8)
        for p in points:
            ys = [100 * w for w in p.waste]
            err = [[100 * (w - lo) for w, lo in zip(p.waste, p.low, strict=True)],
                   [100 * (hi - w) for w, hi in zip(p.waste, p.high, strict=True)]]
            ax.errorbar([t / 60 for t in p.taus], ys, yerr=err, fmt="o", ms=3, capsize=2,
                        label=p.label)
            if p.best is not None:
                ax.plot(p.best[0] / 60, 100 * p.best[1], "*", ms=14, color="black",
                        label=f"best simulated: {p.best[0] / 60:.1f} min")
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint interval τ (minutes)")
        ax.set_ylabel("waste (% of wall time)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        out = Path(path)
        try:
            fig.savefig(out, dpi=110, bbox_inches="tight")
        except OSError as e:
            raise ConfigError(f"--plot: cannot write {str(out)!r}: {e}") from None
        return out
    finally:
        plt.close(fig)


@contextmanager
def transfer_bar(label: str, *, disable: bool) -> Iterator[Callable[[int, int], None]]:
    """A progress bar for long work over bytes (``export``, ``fetch``, ``verify --tier 2``)
    on stderr, so stdout stays the result's; yields the ``progress(done, total)`` callback
    the library's long functions take. ``disable`` (``--json``): no bar at all. Where
    stderr is not a terminal, only its final state is printed, once."""
    bar = Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), disable=disable,
                   redirect_stdout=False, redirect_stderr=False)
    task = bar.add_task(label, total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)
