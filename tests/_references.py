"""The uninterrupted reference runs that several test modules compare their killed, resumed
or relaunched runs with, bit for bit. The session fixtures in tests/conftest.py run each
once; a module that compares with one trains the same workload with the same settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests._launch import WORKLOADS, read_jsonl, run_ranks, torchrun

FSDP_TRAIN = WORKLOADS / "fsdp_train.py"
FSDP_STEPS = 12
"""The fsdp_train.py reference's length (saves after steps 3, 7 and 11); the LR schedule
depends on it, so a run compared with the reference trains as many steps."""


@dataclass(frozen=True)
class FsdpReference:
    """An uninterrupted 2-rank run of tests/workloads/fsdp_train.py (never modify its files)."""

    tier1: Path
    """Its tier-1 root: committed steps 3, 7 and 11 of both ranks."""
    losses: Path
    """Rank 0's JSONL, one ``{"step", "loss", "attempt", "world"}`` line per step."""
    saved: Path
    """The full model and optimizer state at its last save (step 11), ``torch.load``-able."""


def run_fsdp_reference(tmp: Path) -> FsdpReference:
    """fsdp_train.py on 2 ranks under ``torchrun --standalone``, :data:`FSDP_STEPS` steps,
    its full state dumped at the last save."""
    ref = FsdpReference(tier1=tmp / "tier1", losses=tmp / "losses.jsonl",
                        saved=tmp / "saved.pt")
    torchrun(FSDP_TRAIN, "--tier1", str(ref.tier1), "--losses", str(ref.losses), "--steps",
             str(FSDP_STEPS), "--dump-saved", str(ref.saved), nproc=2)
    return ref


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"
EXAMPLE_STEPS, EXAMPLE_SAVE_EVERY = 24, 5
EXAMPLE_SMALL = ("--steps", str(EXAMPLE_STEPS), "--save-every", str(EXAMPLE_SAVE_EVERY),
                 "--layers", "1", "--dim", "32", "--samples", "512", "--timeout", "60")
"""examples/train.py small enough for a test: a 1-layer model of width 32, 24 steps saved
after steps 4, 9, 14, 19 and 23. The reference's rows hold only for these settings."""


def run_example_reference(tmp: Path) -> dict[int, dict[str, Any]]:
    """examples/train.py with :data:`EXAMPLE_SMALL` on 2 ranks, uninterrupted
    (:func:`tests._launch.run_ranks`: the rows torchrun's run logs, to the bit): step →
    rank 0's row (``loss_hex``, ``lr``, ...)."""
    losses = tmp / "losses.jsonl"
    run_ranks(EXAMPLE, "--tier1", str(tmp / "tier1"), "--losses", str(losses),
              *EXAMPLE_SMALL, nproc=2)
    return {r["step"]: r for r in read_jsonl(losses)}
