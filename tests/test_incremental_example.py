"""Incremental saves on the reference user (examples/train.py, FSDP2 on 2 ranks, embeddings
frozen, ``--incremental``): each rank's frozen shard is written once and linked by the later
steps, a SIGKILL resumes bit-identically to an uninterrupted run, and tier 2 receives the
frozen bytes once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._references import EXAMPLE, EXAMPLE_SMALL
from tierckpt.format import layout
from tierckpt.runtime import events

FROZEN = ("--freeze-embeddings", "--incremental", "--keep-last", "10")


def _train(tmp: Path, name: str, *extra: str, restarts: int = 0,
           nproc: int = 2) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1")
    losses = tmp / f"{name}.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
         "--monitor-interval", "0.1", str(EXAMPLE),
         "--tier1", str(tmp / name), "--losses", str(losses), *EXAMPLE_SMALL, *FROZEN,
         *extra],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in losses.read_text().splitlines()]


@pytest.mark.slow
def test_a_killed_incremental_run_resumes_bit_identically_and_uploads_the_base_once(
        tmp_path: Path) -> None:
    ref = {r["step"]: r for r in _train(tmp_path, "reference")}
    t2 = tmp_path / "tier2"
    t2.mkdir()
    rows = _train(tmp_path, "kill", "--kill-at", "12", "--kill-rank", "1",
                  "--tier2", t2.as_uri(), restarts=1)
    assert {r["attempt"] for r in rows} == {0, 1}
    for r in rows:  # resumed from step 9, every loss as the uninterrupted run's
        assert r["loss_hex"] == ref[r["step"]]["loss_hex"], r["step"]

    root = tmp_path / "kill"
    steps = sorted(layout.parse_step_dirname(p.name) for p in root.glob("step-*"))
    assert steps == [4, 9, 14, 19, 23]
    for rank in (0, 1):  # the frozen shard: one file per incarnation, linked by its steps
        inodes = [(root / layout.step_dirname(s) / f"__{rank}_1.distcp").stat().st_ino
                  for s in steps]
        assert len(set(inodes)) == 2 and inodes[0] == inodes[1] and inodes[2] == inodes[4]
    log = events.read_events(root / layout.EVENTS)
    durable = [e for e in log if e["event"] == events.SAVE_DURABLE]
    linked = {(e["step"], e["rank"]) for e in durable if e["linked"] > 0}
    assert linked == {(s, r) for s in (9, 19, 23) for r in (0, 1)}  # 4, 14: first of theirs
    uploads = [e for e in log if e["event"] == events.UPLOAD_VERIFIED]
    assert len(uploads) >= 2 and {e["step"] for e in uploads} <= set(steps)  # newest first
    first, *later = sorted(uploads, key=lambda e: e["step"])
    assert first["bytes"] == first["referenced"]
    frozen = sum((root / layout.step_dirname(23) / f"__{r}_1.distcp").stat().st_size
                 for r in (0, 1))
    for e in later:  # the frozen shards are on tier 2 already: never sent again
        assert e["bytes"] <= e["referenced"] - frozen, e

    # the linked steps reshard as any other: one rank resumes the 2-rank step 23
    more = _train(tmp_path, "kill", "--steps", "26", nproc=1)
    resumed = [r for r in more if r["world_size"] == 1]
    assert [r["step"] for r in resumed] == [24, 25]
