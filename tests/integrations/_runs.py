"""The runs the framework drop-ins' continuity tests compare: a job under torchrun writing
one JSON line per step (and one per restore), and the check that a resumed run's steps
equal the reference's in every compared field."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests._launch import read_jsonl, torchrun


def train(job: Path, tmp: Path, name: str, *args: str, restarts: int = 0
          ) -> list[dict[str, Any]]:
    """Run ``job`` on 2 ranks with its tier 1 at ``tmp/name``; its per-step rows."""
    losses = tmp / f"{name}.jsonl"
    torchrun(job, "--tier1", str(tmp / name), "--losses", str(losses),
             "--restored", str(tmp / f"{name}.restored.jsonl"), *args, max_restarts=restarts)
    return read_jsonl(losses)


def restored(tmp: Path, name: str) -> list[dict[str, Any]]:
    """The restores the run ``name`` logged (none on a fresh start)."""
    path = tmp / f"{name}.restored.jsonl"
    return read_jsonl(path) if path.exists() else []


def assert_same_as(ref: dict[int, dict[str, Any]], rows: list[dict[str, Any]],
                   compared: Sequence[str]) -> None:
    """Every row equals the reference's row of its step in the ``compared`` fields."""
    for row in rows:
        want = {k: ref[row["step"]][k] for k in compared}
        assert {k: row[k] for k in compared} == want, (row["attempt"], row["step"])
