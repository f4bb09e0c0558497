"""The bench's configuration: one frozen value built from the command line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tierckpt.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30
QUICK_SIZE = 64 * MiB
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MiB, "gib": GiB, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "k": 1 << 10, "m": MiB, "g": GiB}


def parse_size(text: str) -> int:
    """Parse ``"1GiB"``, ``"512MiB"``, ``"64M"`` or a plain byte count into bytes (binary K/M/G)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"--size {text!r}: write a number with an optional unit, "
                          "e.g. 1GiB or 256MiB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < MiB:
        raise ConfigError(f"--size {text!r} is below 1 MiB; the bench needs at least 1MiB of state")
    return size


def parse_worlds(text: str) -> tuple[int, ...]:
    """Parse ``"1,2"`` into world sizes; each must be 1..8."""
    try:
        worlds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--world {text!r}: write comma-separated integers, e.g. 1,2") from None
    if not worlds or any(w < 1 or w > 8 for w in worlds):
        raise ConfigError(f"--world {text!r}: each world size must be between 1 and 8")
    return tuple(dict.fromkeys(worlds))


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one bench run measures and where it writes.

    ``size_bytes`` is the whole state (all ranks together); each rank of a world holds about
    ``size_bytes / world``. ``repeats`` timed runs per measurement (the best is reported),
    ``saves`` consecutive saves for the RAM measurement, ``loop_seconds`` of idle training.
    ``target_dir`` receives the checkpoint files (the filesystem under test); ``out_dir`` the
    JSON and Markdown results.
    """

    size_bytes: int
    quick: bool
    worlds: tuple[int, ...]
    out_dir: Path
    target_dir: Path
    repeats: int
    saves: int
    loop_seconds: float

    def __post_init__(self) -> None:
        if self.size_bytes < MiB:
            raise ConfigError("size_bytes must be at least 1 MiB")
        if self.repeats < 1 or self.saves < 2:
            raise ConfigError("repeats must be ≥ 1 and saves ≥ 2")
        if self.loop_seconds <= 0:
            raise ConfigError("loop_seconds must be positive")


def make_config(*, size: str | None, quick: bool, world: str | None, out: Path,
                target: Path) -> BenchConfig:
    """Build the config: ``--quick`` means 64 MiB, one repeat, 3 saves, short loops."""
    size_bytes = parse_size(size) if size else (QUICK_SIZE if quick else GiB)
    worlds = parse_worlds(world) if world else (1, 2)
    return BenchConfig(size_bytes=size_bytes, quick=quick, worlds=worlds, out_dir=out,
                       target_dir=target, repeats=1 if quick else 2, saves=3 if quick else 10,
                       loop_seconds=0.3 if quick else 2.0)
