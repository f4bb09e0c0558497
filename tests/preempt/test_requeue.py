"""Under Slurm the job requeues itself after an announced notice whose emergency save
committed (preempt/requeue.py): the rule on values, the ``scontrol`` calls against a fake
``scontrol`` on PATH (what it was asked, what it answered), and the loop contract in one
process ending in exactly one ``scontrol requeue``. The real cluster's run is in
tests/slurm/test_own_script.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.launch.outcome import decide as outcome_decide
from tierckpt.launch.outcome import requeued_by_job
from tierckpt.preempt.config import EXIT_PREEMPTED, Preemption
from tierckpt.preempt.notice import Notice
from tierckpt.preempt.requeue import Decision, after_emergency_save, decide, notice_kind
from tierckpt.runtime import events as ev
from tierckpt.runtime.scheduler import SlurmFacts

LOOP = Path(__file__).parent / "scripts" / "loop.py"

FAKE_SCONTROL = """#!/bin/bash
# A stand-in for Slurm's scontrol: records each call, answers `-o show job` from FAKE_*.
echo "$*" >> "$FAKE_SLURM_LOG"
case "$1 $2 $3" in
  "-o show job") echo "JobId=$4 JobName=t JobState=RUNNING Reason=${FAKE_REASON:-None}" \\
      "Requeue=${FAKE_REQUEUE:-1} Restarts=${FAKE_RESTARTS:-0}" \\
      "PreemptTime=${FAKE_PREEMPT:-None} Partition=low" ;;
  "requeue "*) [ "${FAKE_REQUEUE_RC:-0}" = 0 ] || echo "Requested operation refused" >&2
      exit "${FAKE_REQUEUE_RC:-0}" ;;
  *) exit 1 ;;
esac
"""


def facts(*, preempted: bool = False, reason: str = "None", requeue: bool = True,
          restarts: int = 0) -> SlurmFacts:
    return SlurmFacts(job_id="42", state="RUNNING", reason=reason, preempted=preempted,
                      restarts=restarts, requeue=requeue)


@pytest.mark.parametrize(("f", "kind", "limit", "requeue", "why"), [
    (facts(preempted=True), "term", None, True, "preempted; emergency save of step 7"),
    (facts(), "usr1", None, True, "time limit ahead (--signal); emergency save of step 7"),
    (facts(), "term", None, False, "cancelled by its user"),
    (facts(reason="TimeLimit"), "term", None, False, "did not come from Slurm"),
    (facts(), None, None, False, "did not come from Slurm"),
    (facts(preempted=True, requeue=False), "term", None, False,
     "submit it with #SBATCH --requeue"),
    (facts(preempted=True, restarts=3), "term", 3, False, "requeue limit 3 reached"),
    (facts(preempted=True, restarts=2), "term", 3, True, "preempted"),
], ids=["preempted", "time-limit-lead", "scancel", "time-limit-without-lead", "file-trigger",
        "not-requeueable", "at-the-limit", "below-the-limit"])
def test_the_rule(f: SlurmFacts, kind: str | None, limit: int | None, requeue: bool,
                  why: str) -> None:
    d = decide(f, kind=kind, step=7, reached=["tier1"], limit=limit)
    assert d.requeue is requeue and why in d.why, d


def test_nothing_reached_is_never_requeued() -> None:
    assert not decide(facts(preempted=True), kind="term", step=7, reached=[], limit=None).requeue


def test_the_notice_kind_survives_the_store() -> None:
    own = Notice("signal:SIGUSR1", 1.0, 2.0)
    via = Notice("rank:3", 1.0, 2.0, detail="signal:SIGTERM")
    assert [notice_kind(n) for n in (own, via, Notice("file:/x", 1.0, 2.0), None)] == [
        "usr1", "term", None, None]


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ``scontrol`` first on PATH; returns the log of its calls."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    exe = bin_ / "scontrol"
    exe.write_text(FAKE_SCONTROL)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "scontrol.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(log))
    return log


def _record(tmp_path: Path) -> list[dict[str, object]]:
    return [e for e in ev.read_events(tmp_path / "events.jsonl")
            if e["event"] == ev.SLURM_REQUEUE]


def _ask(tmp_path: Path, env: dict[str, str], notice: str = "signal:SIGTERM") -> Decision | None:
    with ev.EventLog(tmp_path / "events.jsonl") as log:
        return after_emergency_save(notice=Notice(notice, 1.0, 2.0), step=7,
                                    reached=["tier1"], log=log, env=env)


def test_a_preempted_job_asks_scontrol_once(fake_slurm: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PREEMPT", "2026-01-01T00:00:00")
    d = _ask(tmp_path, {"SLURM_JOB_ID": "42"})
    assert d is not None and d.requeue, d
    assert fake_slurm.read_text().splitlines() == ["-o show job 42", "requeue 42"]
    [rec] = _record(tmp_path)
    assert rec["requeued"] is True and rec["job_id"] == "42" and rec["step"] == 7
    # the launchers' verdict sees it: 75, and no second requeue
    assert requeued_by_job([rec], 0.0) is rec
    v = outcome_decide(rc=1, notices=["usr1", "term"], saved=None, slurm=facts(),
                       requeued=rec)
    assert (v.code, v.again, v.requeued) == (EXIT_PREEMPTED, False, True)
    assert "the job requeued itself: preempted; emergency save of step 7" in v.why


def test_a_scancel_never_asks_for_a_requeue(fake_slurm: Path, tmp_path: Path) -> None:
    d = _ask(tmp_path, {"SLURM_JOB_ID": "42"})
    assert d is not None and not d.requeue and "cancelled by its user" in d.why
    assert fake_slurm.read_text().splitlines() == ["-o show job 42"]
    assert [r["requeued"] for r in _record(tmp_path)] == [False]


def test_a_refused_requeue_is_logged_never_raised(fake_slurm: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PREEMPT", "2026-01-01T00:00:00")
    monkeypatch.setenv("FAKE_REQUEUE_RC", "1")
    d = _ask(tmp_path, {"SLURM_JOB_ID": "42"})
    assert d is not None and not d.requeue and "Requested operation refused" in d.why
    # not recorded as requeued: a generated script's own `scontrol requeue` is the fallback
    assert requeued_by_job(_record(tmp_path), 0.0) is None


def test_without_scontrol_or_slurm_nothing_breaks(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert _ask(tmp_path, {}) is None and _record(tmp_path) == []  # not under Slurm
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    d = _ask(tmp_path, {"SLURM_JOB_ID": "42"})
    assert d is not None and not d.requeue and "cannot ask scontrol" in d.why
    d = _ask(tmp_path, {"SLURM_JOB_ID": "42", "TIERCKPT_MAX_REQUEUES": "x"})
    assert d is not None and not d.requeue


def test_the_switch_is_a_bool() -> None:
    assert Preemption().slurm_requeue is True
    with pytest.raises(ValueError, match="slurm_requeue must be True or False"):
        Preemption(slurm_requeue="no")  # type: ignore[arg-type]


@pytest.mark.parametrize(("preempt", "requeued"), [("2026-01-01T00:00:00", True),
                                                   ("None", False)],
                         ids=["preempted", "scancel"])
def test_the_loop_contract_requeues_a_preempted_job_once(
        fake_slurm: Path, tmp_path: Path, preempt: str, requeued: bool) -> None:
    """loop.py (the documented loop, nothing about Slurm in it) under a fake Slurm job:
    SIGTERM → emergency save → exit 75, and ``scontrol requeue`` exactly when preempted."""
    root = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "42",
           "FAKE_PREEMPT": preempt}
    p = subprocess.run([sys.executable, str(LOOP), str(root), "--steps", "16",
                        "--notice-at", "6"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == EXIT_PREEMPTED, p.stderr
    calls = fake_slurm.read_text().splitlines()
    assert calls.count("requeue 42") == (1 if requeued else 0), calls
    [rec] = [e for e in ev.read_events(root / "events.jsonl")
             if e["event"] == ev.SLURM_REQUEUE]
    assert rec["requeued"] is requeued and rec["step"] == 6
    assert ("requeued (scontrol requeue)" in p.stderr) is requeued, p.stderr
