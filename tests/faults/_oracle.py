"""The oracle every fault test checks, plus the small model the single-process tests save.

"Resume = the newest checkpoint whose marker, manifest and checksums all verify; no
committed checkpoint lost or altered; never a COMPLETE over a partial directory."

:func:`snapshot` records the CRC32C of every file of every committed checkpoint under a
root; :func:`check_root` compares a root after a fault against that snapshot and returns
what went wrong (an empty list is a pass). :class:`Tally` counts faults tried and
checkpoints lost for the suite's summary (see ``conftest.py``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

import tierckpt
from tierckpt.errors import IntegrityError
from tierckpt.format import checksum, layout
from tierckpt.restore.verify import verify_checkpoint

WIDTH = 48


def make_state(step: int = 0) -> tierckpt.TrainState:
    """A two-layer model whose every weight equals ``step`` (so a restore names its step)."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    set_weights(model, step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model._fault_optimizer = opt  # type: ignore[assignment]  # set_weights steps it first
    return tierckpt.TrainState(model=model, optimizer=opt)


def set_weights(model: nn.Module, step: int) -> None:
    """Every weight := ``step``, as a training step would change them: the optimizer steps
    first (no gradients: it changes nothing, but a save's background copy of the weights —
    staging="overlap" — is waited for in its pre-hook, as in a real loop)."""
    opt = getattr(model, "_fault_optimizer", None)
    if opt is not None:
        opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))


def weights_step(state: tierckpt.TrainState) -> float:
    """The single value every weight holds (asserting they agree)."""
    vals = {float(v) for p in state.model.parameters() for v in p.detach().flatten().unique()}
    assert len(vals) == 1, f"weights are a mix of saves: {sorted(vals)[:5]}"
    return vals.pop()


def save_steps(root: Path, steps: list[int], *, keep_last: int = 10) -> None:
    """Commit ``steps`` (weights = step) into ``root`` with a fresh manager."""
    st = make_state()
    with tierckpt.CheckpointManager(tier1=root, keep_last=keep_last) as ck:
        for s in steps:
            set_weights(st.model, s)
            ck.save(s, st).wait()


def committed(root: Path) -> list[int]:
    """Final-named directories under ``root`` that carry a COMPLETE file (unverified)."""
    out = []
    for name in os.listdir(root):
        step = layout.parse_step_dirname(name)
        if step is not None and os.path.lexists(root / name / layout.COMPLETE):
            out.append(step)
    return sorted(out)


def snapshot(root: Path) -> dict[int, dict[str, int]]:
    """``{step: {file: crc32c}}`` of every committed checkpoint under ``root``."""
    snap = {}
    for step in committed(root):
        d = root / layout.step_dirname(step)
        snap[step] = {p.name: checksum.of_file(p)[0] for p in sorted(d.iterdir()) if p.is_file()}
    return snap


def check_root(root: Path, before: dict[int, dict[str, int]], *,
               retained: int | None = None, domain: tuple[int, ...] | None = None,
               world_size: int | None = None) -> list[str]:
    """Problems in ``root`` after a fault, relative to the ``before`` snapshot.

    * every directory with COMPLETE verifies fully (no COMPLETE over a partial directory);
    * every checkpoint of ``before`` is still there with identical bytes, unless retention
      (``retained`` = keep_last) may have deleted it because enough newer complete ones
      exist now.

    ``domain``/``world_size``: a node-local root holds only these ranks' files.
    """
    problems = []
    valid = []
    for step in committed(root):
        try:
            verify_checkpoint(root / layout.step_dirname(step), step=step, full=True,
                              domain=domain, world_size=world_size)
            valid.append(step)
        except (IntegrityError, OSError) as e:
            problems.append(f"step {step} has COMPLETE but does not verify: {e}")
    after = snapshot(root)
    for step, files in before.items():
        newer = [s for s in valid if s > step]
        may_go = retained is not None and len(newer) >= retained
        if step not in after:
            if not may_go:
                problems.append(f"committed step {step} disappeared")
        elif after[step] != files:
            problems.append(f"committed step {step} changed: {after[step]} != {files}")
    return problems


def newest_valid(root: Path, *, domain: tuple[int, ...] | None = None,
                 world_size: int | None = None) -> int | None:
    """The newest step under ``root`` that verifies fully (the oracle's answer)."""
    for step in sorted(committed(root), reverse=True):
        try:
            verify_checkpoint(root / layout.step_dirname(step), step=step, full=True,
                              domain=domain, world_size=world_size)
            return step
        except (IntegrityError, OSError):
            continue
    return None


def restore_step(root: Path) -> tuple[int | None, float | None]:
    """Restore ``root`` with a fresh manager: (chosen step, the value the weights hold)."""
    st = make_state(-1)
    with tierckpt.CheckpointManager(tier1=root, verify="full") as ck:
        info = ck.restore(st)
    if info is None:
        return None, None
    return info.step, weights_step(st)


@dataclasses.dataclass
class Tally:
    """Faults injected and committed checkpoints lost, per fault family."""

    tried: dict[str, int] = dataclasses.field(default_factory=dict)
    lost: dict[str, int] = dataclasses.field(default_factory=dict)
    fired: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, family: str, *, fired: bool = True, lost: int = 0) -> None:
        self.tried[family] = self.tried.get(family, 0) + 1
        self.fired[family] = self.fired.get(family, 0) + int(fired)
        self.lost[family] = self.lost.get(family, 0) + lost


TALLY = Tally()
