"""The verdict after a launcher's step (pure): run again only after an announced
interruption whose emergency save was committed; and the lead derived from a run's
events."""

from __future__ import annotations

import pytest

from tierckpt.errors import ConfigError
from tierckpt.launch import timing
from tierckpt.launch.outcome import SlurmFacts, decide, emergency_save, finished
from tierckpt.runtime import events as ev

SAVED = {"event": ev.PREEMPT_SAVED, "t": 100.0, "step": 41, "reached": ["tier1"]}


def job(*, preempted: bool = False, reason: str = "None", restarts: int = 0) -> SlurmFacts:
    return SlurmFacts(job_id="7", state="RUNNING", reason=reason, preempted=preempted,
                      restarts=restarts, requeue=True)


@pytest.mark.parametrize(("rc", "notices", "saved", "facts", "again", "code", "why"), [
    (1, [], SAVED, job(preempted=True), True, 75, "preempted; emergency save of step 41"),
    (1, ["usr1"], SAVED, job(), True, 75, "time limit ahead"),
    (0, [], None, job(), False, 0, "the job finished"),
    (1, ["term"], SAVED, job(), False, 1, "cancelled by its user"),
    (1, ["usr1", "term"], SAVED, job(), False, 1, "cancelled by its user"),
    (1, ["usr1", "term"], SAVED, job(reason="TimeLimit"), True, 75, "time limit ahead"),
    (1, [], None, job(preempted=True), False, 1, "no emergency save was committed"),
    (1, [], SAVED, job(preempted=True, restarts=5), False, 75, "requeue limit 5 reached"),
    (1, ["term"], SAVED, None, True, 75, "terminated (SIGTERM)"),
    (7, [], None, None, False, 7, "failed with status 7"),
], ids=["preempted", "time-limit", "finished", "scancel", "scancel-after-lead",
        "at-the-limit", "preempted-unsaved", "requeue-limit", "k8s-term", "k8s-crash"])
def test_decide(rc: int, notices: list[str], saved: dict | None, facts: SlurmFacts | None,
                again: bool, code: int, why: str) -> None:
    v = decide(rc=rc, notices=notices, saved=saved, slurm=facts, max_requeues=5)
    assert (v.again, v.code) == (again, code) and why in v.why, v


def test_a_notice_after_the_job_ran_to_its_end_is_a_finish() -> None:
    """The time limit's USR1 reached torchrun as it exited after the last step: it died of
    it, nothing was saved (nothing needed to be), and the job is done, not failed."""
    closed = {"event": ev.MANAGER_CLOSED, "t": 120.0, "rank": 0, "clean": True,
              "stopped": False}
    assert finished([closed], 100.0) and not finished([closed], 130.0)
    assert not finished([{**closed, "stopped": True}], 100.0)  # left on a notice
    assert not finished([{**closed, "clean": False}], 100.0)   # an error left the loop
    assert not finished([{**closed, "rank": 1}], 100.0)
    v = decide(rc=138, notices=["usr1"], saved=None, slurm=job(), done=True)
    assert (v.again, v.code) == (False, 0) and "run to its end" in v.why
    v = decide(rc=138, notices=["usr1"], saved=None, slurm=job(), done=False)
    assert (v.again, v.code) == (False, 138) and "no emergency save" in v.why


def test_unknown_notice_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown notice"):
        decide(rc=0, notices=["kill"], saved=None)


def test_only_saves_since_the_step_count() -> None:
    recs = [SAVED, {**SAVED, "t": 200.0, "step": 80}, {**SAVED, "t": 300.0, "reached": []}]
    assert emergency_save(recs, 150.0)["step"] == 80  # type: ignore[index]
    assert emergency_save(recs, 250.0) is None


def test_the_lead_from_emergency_saves_and_from_periodic_ones() -> None:
    saves = [{"event": ev.PREEMPT_SAVED, "t": 1.0, "reached": ["tier1"], "seconds": 10.0},
             {"event": ev.PREEMPT_SAVED, "t": 2.0, "reached": ["tier1"], "seconds": 30.0}]
    st = timing.save_time(saves)
    assert st is not None and st.seconds == 32.0 and "2 emergency saves" in st.source
    assert timing.lead(st).seconds == 48
    assert timing.save_time(saves, to="tier2") is None  # never reached tier 2
    periodic = [{"event": ev.SAVE_DURABLE, "t": 1.0, "step": 5, "rank": 0, "bytes": 10**9},
                {"event": ev.SAVE_COMMITTED, "t": 2.0, "step": 5, "rank": 0, "bytes": 10**9,
                 "write_seconds": 20.0, "tier": "tier1"},
                {"event": ev.SAVE_STAGED, "t": 1.0, "step": 5, "rank": 0, "seconds": 3.0}]
    st2 = timing.save_time(periodic)
    assert st2 is not None and st2.seconds == pytest.approx(3.0 + 20.0 + 2.0)
    assert timing.lead(None).seconds == timing.DEFAULT_LEAD_S
    assert timing.lead(st2, given_s=12.5).seconds == 13
    assert timing.lead(timing.SaveTime(1.0, "tier1", "x")).seconds == timing.MIN_LEAD_S
