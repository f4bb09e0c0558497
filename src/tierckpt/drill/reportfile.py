"""The report files every drill writes: ``<name>.json`` and ``<name>.md`` in its output
directory.

:func:`write_report_files` is the one writer the resume, chaos, preemption and heal drills'
reports share; each drill keeps its own document, file name and Markdown rendering.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["write_report_files"]


def write_report_files(doc: dict[str, Any], out: Path, name: str,
                       render: Callable[[dict[str, Any]], str], *,
                       also: Mapping[str, str] | None = None,
                       record: bool = True) -> dict[str, str]:
    """Write ``doc`` to ``<out>/<name>.json`` (indented, values JSON cannot hold as their
    ``str``) and ``render(doc)`` to ``<out>/<name>.md``, creating ``out``; return the paths
    ``{"json": ..., "md": ..., **also}``.

    With ``record`` the paths are stored in ``doc["files"]`` before anything is written, so
    the JSON lists them too; ``also`` names files the caller writes itself (the resume
    drill's timeline picture). Plain writes, JSON first: a reader that needs both waits for
    the function to return.
    """
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out / f"{name}.json"), "md": str(out / f"{name}.md"), **(also or {})}
    if record:
        doc["files"] = files
    Path(files["json"]).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    Path(files["md"]).write_text(render(doc))
    return files
