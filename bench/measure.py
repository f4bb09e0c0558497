"""One measured quantity and how repeated timings reduce to it.

Timings on a shared machine are noisy upward (someone else's work only ever slows us), so a
measurement reports the best of its repeats and keeps every repeat for the record. Rates are
decimal GB/s (10⁹ bytes per second).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Measurement:
    """``bytes`` moved in ``seconds`` (the best repeat); ``runs`` every repeat's seconds."""

    seconds: float
    bytes: int
    runs: tuple[float, ...] = ()
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Decimal GB/s; 0 for a zero-time measurement."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """Plain dict for the results file."""
        out: dict[str, Any] = {"seconds": self.seconds, "bytes": self.bytes, "gbps": self.gbps,
                               "runs": list(self.runs)}
        if self.note:
            out["note"] = self.note
        out.update(self.extra)
        return out


def best_of(runs: list[float], nbytes: int, note: str = "", **extra: Any) -> Measurement:
    """The fastest of ``runs`` (seconds) moving ``nbytes`` each."""
    if not runs:
        raise ValueError("best_of needs at least one run")
    return Measurement(min(runs), nbytes, tuple(runs), note, dict(extra))


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Per repeat, the slowest rank's seconds: a collective save is done when the last rank is."""
    return [max(values) for values in zip(*per_rank, strict=True)]
