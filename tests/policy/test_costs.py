"""per_save: each save's cost is its slowest rank's blocking time, raised to its slowest
rank's measured whole cost (C + slower steps) where there is one."""

from __future__ import annotations

from tierckpt.policy.costs import per_save


def test_slowest_rank_and_the_larger_of_blocked_and_measured_cost() -> None:
    recs = [
        {"event": "save_staged", "step": 10, "rank": 0, "seconds": 0.004},
        {"event": "save_staged", "step": 10, "rank": 1, "seconds": 0.006},
        {"event": "save_cost", "step": 10, "rank": 0, "seconds": 0.30},
        {"event": "save_cost", "step": 10, "rank": 1, "seconds": 0.25},
        {"event": "save_staged", "step": 20, "rank": 0, "seconds": 0.5},
        {"event": "save_cost", "step": 20, "rank": 0, "seconds": -0.1},  # noisy steps
        {"event": "save_staged", "step": 30, "rank": 0, "seconds": 0.2},
        {"event": "save_cost", "step": 40, "rank": 0, "seconds": 9.0},  # no save_staged
        {"event": "save_staged", "step": "x", "seconds": 1.0},
        {"event": "save_staged", "step": 50, "seconds": True},
    ]
    assert per_save(recs) == {10: (0.30, True), 20: (0.5, True), 30: (0.2, False)}
