"""Interval policies as values: fixed steps/seconds, AutoInterval from C, W, R, M and the
failures seen, and the step schedule every rank computes the same way."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tierckpt.errors import ConfigError
from tierckpt.policy import plan
from tierckpt.policy.interval import (
    AutoInterval,
    Every,
    Inputs,
    Schedule,
    decide,
    posterior_node_mtbf,
)

DAY = 86400.0
BASE = Inputs(C=5.0, W=20.0, R=300.0, node_mtbf=30 * DAY, nodes=64, failures=0,
              exposure_s=0.0, C_source="measured", W_source="measured", R_source="default",
              mtbf_source="given")


def test_every_takes_exactly_one_knob() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        Every()
    with pytest.raises(ConfigError, match="exactly one"):
        Every(steps=5, seconds=10)
    with pytest.raises(ConfigError, match="steps"):
        Every(steps=0)
    with pytest.raises(ConfigError, match="min_interval"):
        AutoInterval(min_interval="2h", max_interval="1h")
    assert AutoInterval(node_mtbf="30d").node_mtbf == 30 * DAY


def test_step_schedule_is_the_readme_rule() -> None:
    s = Schedule(Every(steps=4))
    assert [step for step in range(12) if s.should_save(step)] == [3, 7, 11]
    assert s.after_save(3, 0.0, 1.0) is None


def test_time_schedule_turns_seconds_into_steps() -> None:
    s = Schedule(Every(seconds=60))
    s.start(100)
    assert not s.should_save(100) and s.should_save(119)  # after 20 calibration steps
    assert s.after_save(119, 60.0, step_s=2.0) == 149  # 60 s / 2 s per step
    assert not s.should_save(148) and s.should_save(149)
    assert s.after_save(149, 60.0, step_s=120.0) == 150  # at least one step


def test_auto_is_young_on_the_job_mtbf() -> None:
    d = decide(AutoInterval(min_interval=0), BASE)
    M = 30 * DAY / 64
    assert d.M_s == pytest.approx(M)
    assert d.interval_s == pytest.approx(max(math.sqrt(2 * 5.0 * M), 20.0))
    assert d.interval_s == pytest.approx(plan.auto_interval(5.0, M, W=20.0))


def test_tau_follows_c_nodes_and_failures() -> None:
    auto = AutoInterval(min_interval=0)
    tau = decide(auto, BASE).interval_s
    slower = decide(auto, dataclasses.replace(BASE, C=20.0)).interval_s
    assert slower == pytest.approx(2 * tau)  # sqrt(4) : τ follows C
    bigger = decide(auto, dataclasses.replace(BASE, nodes=256)).interval_s
    assert bigger == pytest.approx(tau / 2)  # 4× the nodes: M/4, τ/2
    flaky = dataclasses.replace(BASE, failures=9, exposure_s=DAY)  # 9 failures in a day
    assert posterior_node_mtbf(flaky) == pytest.approx((30 * DAY + 64 * DAY) / 10)
    assert decide(auto, flaky).interval_s == pytest.approx(tau * math.sqrt(9.4 / 30))


def test_tau_is_never_below_w_and_is_clamped() -> None:
    assert decide(AutoInterval(min_interval=0), dataclasses.replace(BASE, C=0.001,
                                                                    W=600.0)).interval_s == 600
    assert decide(AutoInterval(max_interval=120), BASE).interval_s == 120
    assert decide(AutoInterval(min_interval="1h"), BASE).interval_s == 3600


def test_no_failures_raises_the_mtbf_slowly() -> None:
    quiet = dataclasses.replace(BASE, exposure_s=10 * DAY)
    assert BASE.node_mtbf < posterior_node_mtbf(quiet) < BASE.node_mtbf + 10 * DAY * 64 + 1
