"""``tierckpt upload``: copy committed tier-1 checkpoints to tier 2 in the foreground, with
a progress bar per checkpoint; ``--watch`` keeps going until Ctrl-C / SIGTERM.

The same :class:`tierckpt.tier2.uploader.Uploader` and loop
(:func:`tierckpt.tier2.uploader.watch.run`) a job starts in the background: same order,
verification, upload state, back-off and tier-2 retention, and the same per-root lock (a
job's background uploader and this command cannot both serve one root).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from tierckpt.cli._app import command
from tierckpt.cli._render import console, emit_json
from tierckpt.cli._tiers import EXIT_FAILED, failures, tier1_dir
from tierckpt.errors import ConfigError
from tierckpt.policy.units import format_bytes
from tierckpt.tier2.storage.url import FORMS
from tierckpt.tier2.uploader import Uploader, UploaderConfig, UploadResult
from tierckpt.tier2.uploader import watch as watch_loop
from tierckpt.tier2.uploader.process import relay_signals

_OK = ("verified", "files_verified")
"""Results that count as success (``conflict`` is done, but a failure for the user)."""


@command()
def upload(
    tier1: Annotated[Path, typer.Option(help="Tier-1 root to upload from.")],
    tier2: Annotated[str, typer.Option(
        help=f"Tier 2 to upload to: {FORMS}.")],
    watch: Annotated[bool, typer.Option(
        "--watch", help="Keep uploading new checkpoints until Ctrl-C or SIGTERM.")] = False,
    every: Annotated[int, typer.Option(
        help="Upload every Nth checkpoint committed on tier 1, counted as the job counts "
             "(1: every one).")] = 1,
    keep_last: Annotated[int, typer.Option(help="Tier-2 retention: newest kept.")] = 3,
    keep_every: Annotated[int, typer.Option(
        help="Tier-2 retention: multiples of this step kept forever (0: none).")] = 0,
    poll: Annotated[float, typer.Option(help="--watch: seconds between looks at tier 1.")
    ] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (schema in "
                                          "docs/cli.md); no progress bar.")] = False,
) -> None:
    """Upload every due checkpoint from --tier1 to --tier2, then exit.

    Each upload is verified, marker last. Exit 1 if one failed or conflicted with a
    different checkpoint already on tier 2; with --watch, keep going until Ctrl-C or
    SIGTERM."""
    results: list[UploadResult] = []
    with failures():
        if not tier1_dir(tier1).is_dir():
            raise ConfigError(f"tier-1 root {str(tier1_dir(tier1))!r} is not a directory")
        config = UploaderConfig(tier1=tier1_dir(tier1), tier2=tier2, upload_every=every,
                                keep_last=keep_last, keep_every=keep_every, poll_s=poll,
                                count_commits=True)
        bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                       TransferSpeedColumn(), TimeRemainingColumn(),
                       console=Console(stderr=True), disable=as_json, transient=False,
                       redirect_stdout=False, redirect_stderr=False)  # bar: stderr only
        current: list[TaskID] = []

        def progress(done: int, total: int) -> None:
            if current:
                bar.update(current[-1], completed=done, total=total)

        with bar, Uploader(config, progress=progress) as up, _stop_on_signals(watch) as stop:
            def started(step: int) -> None:
                current.append(bar.add_task(f"step {step}", total=None))

            def finished(r: UploadResult) -> None:
                results.append(r)
                if not as_json:
                    console().print(_line(r))
            watch_loop.run(up, stop, poll_s=poll, watch=watch, started=started,
                           finished=finished)
    ok = all(r.status in _OK for r in results)
    if as_json:
        emit_json({"tier1": str(config.tier1), "tier2": tier2,
                   "results": [_result_json(r) for r in results]})
    elif not results:
        console().print("nothing to upload")
    if not ok:
        raise typer.Exit(EXIT_FAILED)


@contextmanager
def _stop_on_signals(install: bool) -> Iterator[threading.Event]:
    """An Event set by SIGINT/SIGTERM while ``install`` (old handlers restored after)."""
    stop = threading.Event()
    if not install:
        yield stop
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    relay_signals(dict.fromkeys(old, stop))  # never set an Event inside a handler
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _result_json(r: UploadResult) -> dict[str, Any]:
    return {"step": r.step, "status": r.status, "bytes": r.bytes, "seconds": r.seconds,
            "error": r.error}


def _line(r: UploadResult) -> str:
    if r.status in _OK:
        return (f"[green]{r.status}[/]: step {r.step}, {format_bytes(r.bytes)} sent in "
                f"{r.seconds:.2f} s")
    return f"[red]{r.status}[/]: step {r.step}: {escape(r.error or '')}"
