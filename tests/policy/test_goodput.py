"""Goodput accounting from event records: the categories sum to the wall time, and lost
work is the steps thrown away by a resume from an older step, at the measured step time."""

from __future__ import annotations

from typing import Any

import pytest

from tierckpt.policy import goodput


def _ev(t: float, event: str, pid: int, **kw: Any) -> dict[str, Any]:
    return {"t": t, "event": event, "pid": pid, "rank": 0, **kw}


def _run() -> list[dict[str, Any]]:
    """Incarnation 1 (pid 1): start at 0, first step 0 at 10 s, 1 s per step, saves after
    steps 9 and 19 (C 0.5 s), killed after step 24 (t = 34.9). Incarnation 2 (pid 2):
    starts at 50, resumes from step 19, first step 20 at 60, runs to step 39 at t = 79."""
    recs = [_ev(0, "process_start", 1, restart_count=0), _ev(10, "first_step", 1, step=0)]
    recs += [_ev(10 + s, "progress", 1, step=s) for s in range(25)]
    recs += [_ev(19.5, "save_staged", 1, step=9, seconds=0.5),
             _ev(29.5, "save_staged", 1, step=19, seconds=0.5),
             _ev(34.9, "progress", 1, step=24)]
    recs += [_ev(50, "process_start", 2, restart_count=1),
             _ev(55, "restore_done", 2, step=19, seconds=2.0),
             _ev(60, "first_step", 2, step=20)]
    recs += [_ev(60 + s - 20, "progress", 2, step=s) for s in range(20, 40)]
    recs += [_ev(69.5, "save_staged", 2, step=29, seconds=0.5)]
    return recs


def test_the_parts_sum_to_the_wall_time_and_each_is_where_it_belongs() -> None:
    g = goodput.account(_run())
    assert g.wall_s == 79.0
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    s = g.seconds
    assert s["startup"] == 10.0 and s["restart"] == pytest.approx(60 - 34.9)
    assert s["blocked"] == 1.5 and s["overlap"] == 0.0
    span1 = 34.9 - 10
    assert s["lost_work"] == pytest.approx((24 - 19) * span1 / 24)  # steps 20–24, redone
    assert s["unaccounted"] == pytest.approx(0.0, abs=1e-9)
    assert g.failures == 1 and g.saves == 3
    assert g.goodput == pytest.approx(s["productive"] / 79.0)


def test_a_prediction_needs_an_mtbf() -> None:
    g = goodput.account(_run(), node_mtbf_s=3600.0, nodes=2)
    assert g.M_s == 1800.0 and g.predicted_waste is not None and 0 < g.predicted_waste < 1
    assert goodput.account([]).wall_s == 0.0


def test_other_processes_are_not_incarnations() -> None:
    """The uploader (source "uploader") and a drill that kills from outside log into the same
    file with rank 0; only training processes are incarnations, and an outside failure
    report marks the training process alive at that time (found on a 60-cycle chaos run,
    where they made restart time exceed the wall time)."""
    recs = _run()
    recs += [_ev(12.0 + i, "upload_started", 99, step=9, source="uploader") for i in range(40)]
    recs += [_ev(33.0, "failure_detected", 77, how="kill")]  # the drill, pid 77
    g = goodput.account(recs)
    assert [i.pid for i in g.incarnations] == [1, 2]
    assert g.incarnations[0].failure_t == 33.0
    assert g.seconds["restart"] == pytest.approx(60 - 33.0)
    assert g.seconds["unaccounted"] == pytest.approx(0.0, abs=1e-9)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)


def test_slower_steps_while_saving_are_their_own_category() -> None:
    # save_cost 2.5 s for step 9 (C 0.5 s): 2 s of steps ran slower while it wrote; the
    # prediction uses the whole cost per save
    recs = [*_run(), _ev(21.0, "save_cost", 1, step=9, seconds=2.5)]
    base, g = goodput.account(_run()), goodput.account(recs)
    assert g.seconds["slowed"] == 2.0 and base.seconds["slowed"] == 0.0
    assert g.seconds["productive"] == pytest.approx(base.seconds["productive"] - 2.0)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert g.C_s == 0.5 and base.C_s == 0.5  # median of 2.5, 0.5, 0.5


def test_each_save_counts_at_its_slowest_rank() -> None:
    """The ranks wait for each other in the next step's collectives: a save blocks the job
    for its slowest rank's C, and its slowed steps are that rank's cost above it. A step
    saved again after the resume (step 24 here, by both incarnations) is two saves."""
    def other(t: float, event: str, **kw: Any) -> dict[str, Any]:
        return {**_ev(t, event, 11 if t < 50 else 12, **kw), "rank": 1}

    recs = [*_run(), _ev(21.0, "save_cost", 1, step=9, seconds=1.5),
            other(19.6, "save_staged", step=9, seconds=0.8),   # rank 1 slower at step 9
            other(21.1, "save_cost", step=9, seconds=2.0),
            other(29.6, "save_staged", step=19, seconds=0.2),  # rank 0 slower at step 19
            other(30.0, "overlap", step=19, seconds=0.3),
            _ev(34.5, "save_staged", 1, step=24, seconds=0.4),  # killed before it committed
            other(34.6, "save_staged", step=24, seconds=0.6),
            _ev(64.5, "save_staged", 2, step=24, seconds=0.3),  # saved again after resuming
            other(64.6, "save_staged", step=24, seconds=0.7)]
    g = goodput.account(recs)
    s = g.seconds
    # step 9: 0.8; 19: 0.5; 24 before the kill: 0.6, after the resume: 0.7; 29: 0.5
    assert s["blocked"] == pytest.approx(0.8 + 0.5 + 0.6 + 0.7 + 0.5)
    assert s["slowed"] == pytest.approx(2.0 - 0.8)  # rank 1's cost above the save's C
    assert s["overlap"] == pytest.approx(0.3)
    assert sum(s.values()) == pytest.approx(g.wall_s)
    base = goodput.account(_run())
    assert s["lost_work"] == pytest.approx(base.seconds["lost_work"])
    assert s["productive"] == pytest.approx(
        base.seconds["productive"] - (s["blocked"] - 1.5) - s["slowed"] - s["overlap"])
