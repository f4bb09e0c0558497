"""Clock jumps and steps going backwards: selection and retention are by step, never by a
timestamp (mtimes, ``created_unix`` in the manifest, event times).

The wall clock is moved for the whole process (``time.time`` jumps back a year between
saves; the monotonic clock that measures durations is left alone) and directory mtimes are
scrambled with ``os.utime``; resume must still choose the highest complete step, and
retention must still delete the lowest. (A step number going backwards on the same root is
refused: ``tests/test_manager.py::test_step_must_increase``; two managers on one root:
``tests/test_manager.py::test_second_job_on_same_root_is_refused``.)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import tierckpt
from tests.faults._oracle import TALLY, committed, make_state, restore_step, set_weights
from tierckpt.format import layout

YEAR = 365 * 24 * 3600.0


def test_wall_clock_going_backwards_between_saves(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "tier1"
    real = time.time
    offset = {"s": 0.0}
    monkeypatch.setattr(time, "time", lambda: real() + offset["s"])
    st = make_state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=2) as ck:
        for step in (1, 2, 3, 4):
            offset["s"] = -step * YEAR  # every save happens "a year before" the previous one
            set_weights(st.model, step)
            ck.save(step, st).wait()
    created = {s: json.loads((root / layout.step_dirname(s) / layout.MANIFEST).read_bytes())
               ["created_unix"] for s in committed(root)}
    assert created[4] < created[3]  # the clock really went backwards
    assert committed(root) == [3, 4]  # retention deleted the lowest steps, not the "newest"
    assert restore_step(root) == (4, 4.0)
    TALLY.add("wall clock jumps back between saves")


def test_scrambled_mtimes_do_not_change_the_choice(tmp_path: Path) -> None:
    root = tmp_path / "tier1"
    st = make_state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=3) as ck:
        for step in (1, 2, 3):
            set_weights(st.model, step)
            ck.save(step, st).wait()
    now = time.time()
    stamps = {1: now + 10 * YEAR, 2: now, 3: 0.0}  # the oldest step looks newest on disk
    for step, t in stamps.items():
        d = root / layout.step_dirname(step)
        for p in (d, *d.iterdir()):
            os.utime(p, (t, t), follow_symlinks=False)
    assert restore_step(root) == (3, 3.0)
    with tierckpt.CheckpointManager(tier1=root, keep_last=3) as ck:
        ck.restore(st)
        set_weights(st.model, 4)
        ck.save(4, st).wait()
    assert committed(root) == [2, 3, 4]  # step 1 (mtime in the future) was the one deleted
    TALLY.add("directory mtimes scrambled")
