"""Resume drills as code: kill, continuity, reshard, tier-2-only restore, and the report.

``run_drills(DrillConfig(command=("python", "examples/train.py", ...)))`` runs the training
command under torchrun several times (see :mod:`tierckpt.drill.drills` for the order and
:mod:`tierckpt.drill.launch` for what the command must accept) and writes
``drill-report.json``, ``drill-report.md`` and ``drill-timeline.png`` (schema in
docs/drills.md). The verdicts are deterministic on CPU: bit-identical losses after a kill.

Modules: ``verdicts`` (pure: where to kill, continuity, samples, R's parts), ``launch``
(torchrun agents), ``inject`` (the SIGKILL from outside), ``runs`` (one job and its
records; checkpoint chores), ``drills`` (the order), ``report`` (JSON, Markdown, PNG).
The chaos drill (``tierckpt drill --chaos N``, :func:`tierckpt.drill.chaos.run_chaos`):
``chaos_verdicts`` (pure: the fault catalogue, the seeded plan, every invariant),
``chaos_faults`` (the injectors and what watches the job), ``chaos`` (the order),
``chaos_report`` (JSON, Markdown).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierckpt.drill.drills import DRILLS, DrillConfig, Progress, run_drills
    from tierckpt.drill.report import SCHEMA, VERDICTS, render_markdown, write_report

__all__ = ["DRILLS", "SCHEMA", "VERDICTS", "DrillConfig", "Progress", "render_markdown",
           "run_drills", "write_report"]

_HOME = {"DRILLS": "drills", "DrillConfig": "drills", "Progress": "drills",
         "run_drills": "drills", "SCHEMA": "report", "VERDICTS": "report",
         "render_markdown": "report", "write_report": "report"}


def __getattr__(name: str) -> Any:
    """The names of :data:`__all__`, imported on first use: the drills import torch, and
    a helper process of the chaos drill (:mod:`tierckpt.drill.chaos_objects`) needs none
    of it."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
