"""The whole cost of each save, from event records (pure: records in, numbers out).

A save costs the loop its blocking time C (``save_staged``) and, while it copies and writes
in the background, slower steps; :mod:`tierckpt.runtime.save_cost` measures the two together
as ``save_cost`` where the loop marks its steps. Planning uses the larger of the two per
save, for the slowest rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def per_save(records: Iterable[Mapping[str, Any]]) -> dict[int, tuple[float, bool]]:
    """Per saved step: ``(cost, measured)`` — the slowest rank's ``save_staged`` seconds (C),
    raised to the slowest rank's ``save_cost`` where one was measured (``measured`` True).
    Steps with a ``save_cost`` but no ``save_staged`` are left out."""
    blocked: dict[int, float] = {}
    cost: dict[int, float] = {}
    for r in records:
        s, step = r.get("seconds"), r.get("step")
        if not isinstance(s, int | float) or isinstance(s, bool) or not isinstance(step, int):
            continue
        into = blocked if r.get("event") == "save_staged" else \
            cost if r.get("event") == "save_cost" else None
        if into is not None:
            into[step] = max(into.get(step, float("-inf")), float(s))
    return {step: (max(c, cost[step]), True) if step in cost else (c, False)
            for step, c in blocked.items()}
