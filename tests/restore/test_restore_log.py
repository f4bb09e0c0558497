"""What a restore logs on the "tierckpt" logger across real ranks: a damaged checkpoint set
aside is one line for the job (not one per rank), and a restore onto another world size
says so in one line."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tests._launch import spawn
from tierckpt._ports import free_port
from tierckpt.format import layout
from tierckpt.restore.restorer import reshard_note

pytestmark = pytest.mark.slow  # two spawned jobs of real ranks


def _job(rank: int, world: int, port: int, root: str, logs: str, save: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    handler = logging.FileHandler(Path(logs) / f"rank{rank}.log")
    logging.getLogger("tierckpt").addHandler(handler)
    tierckpt.init_distributed()
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    state = tierckpt.TrainState(model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with tierckpt.CheckpointManager(tier1=root) as ckpt:
        if save:
            ckpt.save(1, state).wait()
            ckpt.save(2, state).wait()
        else:
            restored = ckpt.restore(state)
            assert restored is not None and restored.step == 1 and restored.resharded
    handler.close()


def test_a_damaged_step_and_a_reshard_are_each_one_line_for_the_job(tmp_path: Path) -> None:
    root, logs = tmp_path / "tier1", tmp_path / "logs"
    logs.mkdir()
    spawn(_job, 2, free_port(), str(root), str(logs), True, nprocs=2)
    shard = max((root / layout.step_dirname(2)).glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    for f in logs.iterdir():
        f.unlink()
    spawn(_job, 3, free_port(), str(root), str(logs), False, nprocs=3)
    lines = [line for f in sorted(logs.iterdir()) for line in f.read_text().splitlines()]
    set_aside = [line for line in lines if "failed to load and was set aside" in line]
    assert len(set_aside) == 1 and set_aside[0].startswith("step 2 "), lines
    assert [line for line in lines if "is restored onto" in line] == [reshard_note(1, 2, 3)]


def test_the_reshard_note_names_both_world_sizes_and_what_changes() -> None:
    note = reshard_note(59, 2, 3)
    assert note.startswith("step 59 was saved by 2 rank(s) and is restored onto 3")
    assert "resharded" in note and "RNG" in note and "bit for bit" in note
