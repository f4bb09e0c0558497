"""``tierckpt simulate`` through the real CLI (small replica counts: each run < 1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._helpers import flags, invoke, invoke_json

FAST = ("--replicas", "40", "--sweep-replicas", "20", "--points", "9")


def test_json_reports_simulation_next_to_analytic() -> None:
    doc = invoke_json("simulate", "--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h",
                      "--job-length", "365d", "--seed", "3", *FAST)
    lo, hi = doc["ci"]
    assert lo < doc["waste_fraction"] < hi
    an = doc["analytic"]
    assert round(100 * an["first_order"], 1) == 7.4
    assert an["exact_in_ci"] is True
    assert lo <= an["exact_exponential"] <= hi
    assert doc["interval_s"] == pytest.approx((2 * 60 * 43200) ** 0.5)
    assert set(doc["waste_parts"]) == {"ckpt", "rework", "restart"}
    assert doc["failures_mean"] > 600
    sw = doc["sweep"]
    assert len(sw["points"]) == 9
    assert sw["best_waste_fraction"] == min(p["waste_fraction"] for p in sw["points"])
    assert sw["exact_best_interval_s"] == pytest.approx(sw["daly_interval_s"], rel=1e-3)


def test_same_seed_reproduces() -> None:
    args = ("simulate", "--blocking", "5s", "--restart", "5m", "--job-mtbf", "12h",
            "--job-length", "60d", "--no-sweep", *FAST)
    a = invoke_json(*args, "--seed", "1")
    assert a == invoke_json(*args, "--seed", "1")
    assert a["waste_fraction"] != invoke_json(*args, "--seed", "2")["waste_fraction"]
    assert a["sweep"] is None


def test_weibull_and_interval_flags() -> None:
    doc = invoke_json("simulate", "--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h",
                      "--failures", "weibull", "--interval", "30m", "--no-sweep", *FAST)
    assert doc["inputs"]["failures"] == "weibull"
    assert doc["inputs"]["shape"] == 0.7  # default shape for weibull
    assert doc["interval_s"] == 1800.0


def test_human_output_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "sim.png"
    result = invoke("simulate", "--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h",
                    "--plot", str(out), *FAST)
    assert result.exit_code == 0, result.output
    for fragment in ("simulated", "first order", "exact", "best simulated interval"):
        assert fragment in result.stdout
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("args", "fragment"), [
    (("--blocking", "60s", "--restart", "15m"), "missing MTBF"),
    (("--blocking", "60s", "--job-mtbf", "12h"), "--restart"),
    (("--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h", "--failures", "gamma"),
     "--failures"),
    (("--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h", "--shape", "2"),
     "--shape"),
    (("--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h", "--replicas", "1"),
     "--replicas"),
    (("--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h", "--job-length", "0d"),
     "--job-length"),
    (("--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h", "--interval", "-1m"),
     "--interval"),
    (("--blocking", "60s", "--restart", "15m", "--job-mtbf", "12h", "--confidence", "2"),
     "--confidence"),
])
def test_bad_input_exits_2_naming_the_flag(args: tuple[str, ...], fragment: str) -> None:
    result = invoke("simulate", *args)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr


def test_default_replicas_shrink_for_very_long_jobs() -> None:
    """A 10-year job at M = 1 h (~90 000 failures each): ~2M simulated failures in all."""
    doc = invoke_json("simulate", "--blocking", "5s", "--restart", "1m", "--job-mtbf", "1h",
                      "--job-length", "3650d", "--no-sweep")
    assert doc["inputs"]["replicas"] == 22
    assert doc["failures_mean"] > 80_000
    assert doc["analytic"]["exact_in_ci"] is True
    short = invoke_json("simulate", "--blocking", "5s", "--restart", "1m", "--job-mtbf", "12h",
                        "--job-length", "30d", "--no-sweep")
    assert short["inputs"]["replicas"] == 200


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("simulate") == {
        "--blocking", "--confidence", "--failures", "--from-drill", "--from-events",
        "--interval", "--job-length", "--job-mtbf", "--json", "--no-sweep",
        "--node-mtbf", "--nodes", "--plot", "--points", "--replicas", "--restart",
        "--seed", "--shape", "--sweep", "--sweep-replicas", "--write-time"
    }
