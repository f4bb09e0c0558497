"""Planning arithmetic, tested with values alone (DESIGN.md's worked numbers)."""

from __future__ import annotations

import math

import pytest

from tierckpt.errors import ConfigError
from tierckpt.policy import plan

H = 3600.0
MIN = 60.0


# ---------------------------------------------------------------- sizing


@pytest.mark.parametrize(("kwargs", "total", "parts"), [
    ({}, 14, (2, 4, 8)),
    ({"weights": "fp32"}, 12, (4, 0, 8)),
    ({"master_fp32": False}, 10, (2, 0, 8)),
    ({"optimizer": "adamw", "weights": "fp16"}, 14, (2, 4, 8)),
    ({"optimizer": "sgd-momentum"}, 10, (2, 4, 4)),
    ({"optimizer": "sgd", "weights": "fp32"}, 4, (4, 0, 0)),
])
def test_bytes_per_param(kwargs: dict[str, object], total: int,
                         parts: tuple[int, int, int]) -> None:
    bpp = plan.bytes_per_param(**kwargs)  # type: ignore[arg-type]
    assert bpp.total == total
    assert (bpp.weights, bpp.master, bpp.optimizer) == parts


def test_checkpoint_size_design_examples() -> None:
    assert plan.checkpoint_size(8_000_000_000).total_bytes == 112 * 10**9
    size = plan.checkpoint_size(70_000_000_000, nodes=8, gpus_per_node=8)
    assert size.total_bytes == 980 * 10**9
    assert size.per_node_bytes == 122_500_000_000
    assert size.per_rank_bytes == math.ceil(980e9 / 64)


def test_checkpoint_size_extra_and_rounding_up() -> None:
    size = plan.checkpoint_size(10, extra_bytes=3, nodes=4, gpus_per_node=2)
    assert size.total_bytes == 143
    assert size.per_node_bytes == 36  # shares round up: 4 × 36 ≥ 143
    assert size.per_rank_bytes == 18


def test_write_time_of_a_node_share() -> None:
    share = plan.checkpoint_size(70_000_000_000, nodes=8).per_node_bytes
    assert plan.write_time(share, 4e9) == pytest.approx(30.625)


def test_staging_fit_margin() -> None:
    fit = plan.staging_fit(122_500_000_000, 2 * 2**40, 512 * 2**30)
    assert fit.fits
    assert fit.margin_bytes == 2 * 2**40 - 512 * 2**30 - 122_500_000_000
    tight = plan.staging_fit(1000, 1500, 600)
    assert not tight.fits and tight.margin_bytes == -100


@pytest.mark.parametrize(("call", "name"), [
    (lambda: plan.checkpoint_size(0), "params"),
    (lambda: plan.checkpoint_size(10, nodes=0), "nodes"),
    (lambda: plan.checkpoint_size(10, optimizer="lion"), "optimizer"),
    (lambda: plan.checkpoint_size(10, weights="int4"), "weights"),
    (lambda: plan.write_time(10, 0), "bandwidth"),
])
def test_sizing_errors_name_the_argument(call: object, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        call()  # type: ignore[operator]


# ----------------------------------------------------------- MTBF and interval


def test_job_mtbf_is_node_mtbf_over_nodes() -> None:
    assert plan.job_mtbf(32 * 86400, 64) == pytest.approx(12 * H)
    assert plan.resolve_job_mtbf(node_mtbf_s=32 * 86400, nodes=64) == pytest.approx(12 * H)
    assert plan.resolve_job_mtbf(job_mtbf_s=5.0) == 5.0


@pytest.mark.parametrize(("kwargs", "name"), [
    ({}, "missing MTBF"),
    ({"node_mtbf_s": 100.0}, "nodes"),
    ({"job_mtbf_s": 1.0, "node_mtbf_s": 1.0}, "not both"),
    ({"job_mtbf_s": -1.0}, "job-mtbf"),
    ({"node_mtbf_s": 10.0, "nodes": 0}, "nodes"),
])
def test_resolve_job_mtbf_errors(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        plan.resolve_job_mtbf(**kwargs)  # type: ignore[arg-type]


def test_design_example_sync() -> None:
    """M = 12 h, C = 60 s, R = 15 min → τ ≈ 38 min and 7.4 % waste."""
    p = plan.plan_interval(60.0, 12 * H, 15 * MIN)
    assert p.interval_s == pytest.approx(math.sqrt(2 * 60 * 12 * H))
    assert round(p.interval_s / MIN) == 38
    assert round(100 * p.waste.total, 1) == 7.4
    assert p.waste.ckpt == pytest.approx(p.waste.rework)  # equal at Young's optimum
    assert p.waste.restart == pytest.approx(15 / 720)
    assert not p.overlap


def test_design_example_async() -> None:
    """C = 5 s, R = 5 min → τ ≈ 11 min and 2.2 %."""
    p = plan.plan_interval(5.0, 12 * H, 5 * MIN)
    assert round(p.interval_s / MIN) == 11
    assert round(100 * p.waste.total, 1) == 2.2


def test_compare_reproduces_the_worked_example_in_order() -> None:
    plans = plan.compare([plan.Strategy(name="sync", C=60, R=15 * MIN),
                          plan.Strategy(name="async", C=5, R=5 * MIN)], 12 * H)
    assert [p.name for p in plans] == ["sync", "async"]
    assert [round(100 * p.waste.total, 1) for p in plans] == [7.4, 2.2]
    with pytest.raises(ConfigError):
        plan.compare([], 12 * H)


def test_daly_interval_formula_and_limit() -> None:
    C, M = 60.0, 12 * H
    x = C / (2 * M)
    expected = math.sqrt(2 * C * M) * (1 + math.sqrt(x) / 3 + x / 9) - C
    assert plan.daly_interval(C, M) == pytest.approx(expected)
    # C ≪ M: Daly → Young
    assert plan.daly_interval(1e-3, 1e6) / plan.young_interval(1e-3, 1e6) == pytest.approx(
        1.0, abs=1e-4)


def test_daly_is_the_optimum_of_the_exact_model() -> None:
    """Daly's higher-order interval minimises the exact exponential waste (W = 0)."""
    for C, M, R in [(60.0, 12 * H, 900.0), (5.0, H, 60.0), (600.0, 6 * H, 0.0)]:
        best = plan.best_exact_interval(C, M, R)
        assert best == pytest.approx(plan.daly_interval(C, M), rel=2e-3)
        assert plan.exact_waste(C, best, M, R) <= plan.exact_waste(C, 1.1 * best, M, R)
        assert plan.exact_waste(C, best, M, R) <= plan.exact_waste(C, 0.9 * best, M, R)


def test_exact_waste_agrees_with_first_order_when_small() -> None:
    C, M, R = 1.0, 100 * H, 10.0
    tau = plan.young_interval(C, M)
    first = plan.waste(C, tau, M, R).total
    assert plan.exact_waste(C, tau, M, R) == pytest.approx(first, rel=2e-3)


def test_first_order_overstates_when_not_small() -> None:
    C, M, R = 0.3 * H, H, 0.5 * H
    tau = plan.young_interval(C, M)
    assert plan.waste(C, tau, M, R).total > 1.0  # nonsense: more than all the time
    assert 0.0 < plan.exact_waste(C, tau, M, R) < 1.0


def test_write_time_adds_rework() -> None:
    base = plan.waste(5.0, 600.0, 12 * H, 300.0)
    with_w = plan.waste(5.0, 600.0, 12 * H, 300.0, W=30.0)
    assert with_w.rework - base.rework == pytest.approx(30.0 / (12 * H))
    assert with_w.ckpt == base.ckpt and with_w.restart == base.restart
    assert with_w.total == pytest.approx(with_w.ckpt + with_w.rework + with_w.restart)


def test_overlap_flag_and_auto_interval() -> None:
    p = plan.plan_interval(5.0, 12 * H, 300.0, W=900.0)
    assert p.overlap  # τ ≈ 657 s < W = 900 s
    assert plan.auto_interval(5.0, 12 * H, W=900.0) == 900.0
    assert plan.auto_interval(5.0, 12 * H) == pytest.approx(plan.young_interval(5.0, 12 * H))
    assert plan.auto_interval(5.0, 12 * H, rule="daly") == pytest.approx(
        plan.daly_interval(5.0, 12 * H))
    assert plan.auto_interval(5.0, 12 * H, max_s=300.0) == 300.0
    assert plan.auto_interval(5.0, 12 * H, min_s=3600.0) == 3600.0


def test_rule_daly_picks_daly() -> None:
    p = plan.plan_interval(60.0, 12 * H, 900.0, rule=plan.Rule.DALY)
    assert p.interval_s == p.daly_s < p.young_s


def test_node_days_per_month() -> None:
    assert plan.node_days_per_month(0.05, 100) == pytest.approx(150.0)


@pytest.mark.parametrize(("call", "name"), [
    (lambda: plan.young_interval(0.0, 10.0), "C"),
    (lambda: plan.young_interval(-1.0, 10.0), "C"),
    (lambda: plan.young_interval(10.0, 10.0), "smaller than M"),
    (lambda: plan.daly_interval(5.0, 0.0), "M"),
    (lambda: plan.waste(5.0, 0.0, 100.0), "tau"),
    (lambda: plan.waste(5.0, 10.0, 100.0, -1.0), "R"),
    (lambda: plan.waste(5.0, 10.0, 100.0, W=-1.0), "W"),
    (lambda: plan.plan_interval(5.0, 100.0, rule="fast"), "rule"),
    (lambda: plan.young_interval(float("inf"), 10.0), "C"),
])
def test_interval_errors_name_the_argument(call: object, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        call()  # type: ignore[operator]
