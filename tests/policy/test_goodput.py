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


def _preempted_run(reached: list[str] | None = None) -> list[dict[str, Any]]:
    """_run(), then incarnation 2 gets a notice at t = 74.3 (in step 34); every rank stops
    after step 35: the emergency save (C 0.5 s), preempt_stop at 75.6, preempt_saved at 80.
    Incarnation 3 (pid 3) starts at 100, resumes from step 35, first step 36 at 110, runs to
    step 45 at t = 119. ``reached=[]``: the save reached no tier (not announced)."""
    recs = [r for r in _run() if r["t"] < 75]
    recs += [_ev(74.3, "preempt_notice", 2, source="signal:SIGTERM", received_unix=74.3,
                 deadline_unix=104.3, detail=""),
             _ev(75.0, "progress", 2, step=35),
             _ev(75.5, "save_staged", 2, step=35, seconds=0.5),
             _ev(75.6, "preempt_stop", 2, step=35, source="signal:SIGTERM", notice_s=1.3,
                 deadline_unix=104.3),
             _ev(78.0, "save_committed", 2, step=35, seconds=2.5, write_seconds=2.0,
                 bytes=10, tier="tier1"),
             _ev(80.0, "preempt_saved", 2, step=35,
                 reached=["tier1", "tier2"] if reached is None else reached, abandoned={},
                 seconds=5.7, remaining_s=24.3),
             _ev(80.0, "preempt_exit", 2, step=35, code=75)]
    recs += [_ev(100, "process_start", 3, restart_count=2),
             _ev(105, "restore_done", 3, step=35, seconds=2.0),
             _ev(110, "first_step", 3, step=36)]
    recs += [_ev(110 + s - 36, "progress", 3, step=s) for s in range(36, 46)]
    return recs


def test_announced_and_unannounced_interruptions_are_split() -> None:
    g = goodput.account(_preempted_run())
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert g.seconds["unaccounted"] == pytest.approx(0.0, abs=1e-9)
    killed, preempted = g.interruptions
    assert killed.kind == "unannounced" and killed.at_t == 34.9
    assert killed.lost_steps == 5 and killed.restart_s == pytest.approx(60 - 34.9)
    assert preempted.kind == "announced" and preempted.at_t == 75.6  # the agreed stop
    assert preempted.lost_steps == 0 and preempted.lost_work_s == 0.0
    assert preempted.restart_s == pytest.approx(110 - 75.6)  # the carry counts as restart
    assert g.seconds["restart"] == pytest.approx(killed.restart_s + preempted.restart_s)
    assert (g.failures, g.announced) == (1, 1)
    assert g.R_s == pytest.approx(killed.restart_s)  # R and M: the unannounced only
    kinds = g.by_kind()
    assert kinds["announced"] == {"count": 1, "lost_steps": 0, "lost_work_s": 0.0,
                                  "restart_s": pytest.approx(34.4)}
    assert kinds["unannounced"]["lost_work_s"] == pytest.approx(killed.lost_work_s)
    doc = g.to_json()
    assert doc["announced"] == 1 and doc["failures"] == 1
    assert doc["interruptions_by_kind"]["unannounced"]["count"] == 1
    assert [i["kind"] for i in doc["interruptions"]] == ["unannounced", "announced"]


def test_a_notice_whose_save_reached_nothing_is_unannounced() -> None:
    g = goodput.account(_preempted_run(reached=[]))
    assert [i.kind for i in g.interruptions] == ["unannounced", "unannounced"]
    assert g.failures == 2 and g.announced == 0
    # no committed emergency save: training is counted to the incarnation's last event
    assert g.interruptions[1].at_t == 80.0


def test_a_run_without_notices_has_only_unannounced_interruptions() -> None:
    g = goodput.account(_run())
    assert [i.kind for i in g.interruptions] == ["unannounced"]
    assert g.by_kind()["announced"]["count"] == 0


def _slurm_run() -> list[dict[str, Any]]:
    """_preempted_run() under Slurm job 812: the kill is restarted by torchrun inside the
    job's first run; the preemption is requeued (SLURM_RESTART_COUNT 1) and torchrun's count
    starts again at 0."""
    where = {1: (0, 0), 2: (0, 1), 3: (1, 0)}  # pid: (requeue, torchrun restart)
    out = []
    for r in _preempted_run():
        if r["event"] == "process_start":
            requeue, restart = where[r["pid"]]
            r = {**r, "restart_count": restart,
                 "scheduler": {"name": "slurm", "job_id": "812", "restarts": requeue}}
        out.append(r)
    return out


def test_each_incarnation_says_which_run_of_the_job_it_was() -> None:
    incs = goodput.account(_slurm_run()).incarnations
    assert [(i.scheduler, i.job_id, i.requeue, i.restart_count) for i in incs] == [
        ("slurm", "812", 0, 0), ("slurm", "812", 0, 1), ("slurm", "812", 1, 0)]
    assert [(i.resumed_from, i.announced) for i in incs] == [(None, False), (19, True),
                                                             (35, False)]
    plain = goodput.account(_run()).incarnations
    assert [(i.scheduler, i.requeue, i.restart_count) for i in plain] == [(None, None, 0),
                                                                          (None, None, 1)]
