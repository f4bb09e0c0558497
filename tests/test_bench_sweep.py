"""bench/sweep.py: a tiny sweep end to end (real gloo ranks, files, fsync) — every metric,
a fit per metric and world, the table and the plot — and bench/sweep_fit.py's fits and
planner, and the input checks, with values alone. Asserts shape and consistency, never
speed."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from bench.run import main as bench_main
from bench.sweep import FIXED_SIZE, SCHEMA, measure_sweep, parse_sizes, room_for, run_sweep
from bench.sweep_fit import LLAMA3_GPUS, METRICS, fit_line, planner_scale
from tierckpt.errors import ConfigError

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

MiB = 1 << 20


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    base = tmp_path_factory.mktemp("sweep")
    rc = run_sweep(sizes="2MiB,8MiB", world="1,2", out=base / "out", target=base / "target",
                   repeats=1)
    assert rc == 0
    (json_path,) = (base / "out").glob("*-sweep.json")
    (md_path,) = (base / "out").glob("*-sweep.md")
    return json.loads(json_path.read_text()), md_path.read_text(), base


@pytest.mark.slow
def test_every_point_has_every_metric(sweep: tuple[dict[str, Any], str, Path]) -> None:
    r, _, base = sweep
    assert r["schema"] == SCHEMA and r["errors"] == []
    assert r["sizes"] == [2 * MiB, 8 * MiB] and r["worlds"] == [1, 2]
    points = [*r["points"], *r["fixed"].values()]
    assert len(points) == 6 and not any("skipped" in p for p in points)
    for p in points:
        for metric in METRICS:
            m = p[metric]
            assert m["seconds"] > 0 and m["seconds"] == min(m["runs"]), (metric, m)
            assert m["bytes"] == p["bytes"] == pytest.approx(p["size_bytes"], rel=0.01)
        assert isinstance(p["restore_cold"]["cold"], bool)
        assert 0 < p["own_files_read"]["seconds"] == min(p["own_files_read"]["runs"])
        assert p["durable"]["seconds"] >= p["C"]["seconds"]
        assert p["write_s"] > 0 and p["commit_s"] >= 0
        assert p["durable"]["seconds"] >= p["write_s"]
        assert p["ram"]["peak_extra_bytes"] > 0 and p["ram"]["ratio"] > 0
        assert p["bytes_per_rank"] * p["world"] >= p["bytes"]
        assert p["start_seconds"] > p["pg_init_seconds"] > 0 and p["manager_open_seconds"] > 0
    assert {p["size_bytes"] for p in r["fixed"].values()} == {FIXED_SIZE}
    assert set(r["pg_init_seconds"]) == set(r["process_start_seconds"]) == {"1", "2"}
    assert not list((base / "target").iterdir()), "the sweep left files behind"


def test_a_fit_per_metric_and_world(sweep: tuple[dict[str, Any], str, Path]) -> None:
    r, _, _ = sweep
    for w in ("1", "2"):
        for metric in (*METRICS, "ram"):
            f = r["fits"][w][metric]
            assert f is not None and f["points"] == 2 and f["r2"] == pytest.approx(1.0)
            if metric != "ram":
                assert "rate_gbps" in f
    flat = r["flatness"]
    assert flat["bytes_per_rank"] > 0
    for metric in METRICS:
        assert flat["metrics"][metric]["1"]["vs_first"] == pytest.approx(1.0)


def test_table_plot_and_planner(sweep: tuple[dict[str, Any], str, Path]) -> None:
    r, md, _ = sweep
    png = Path(r["plot"])
    assert png.suffix == ".png" and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for heading in ("## Points", "## Fits", "## Fixed overheads", "## Planner"):
        assert heading in md
    rows = md.splitlines()  # a point's row starts with its world and state
    assert sum(r.startswith("| 1 | 2 MiB |") for r in rows) == 1
    assert sum(r.startswith("| 2 | 8 MiB |") for r in rows) == 1
    pl = r["planner"]
    assert pl["C_s"] > 0 and pl["W_s"] >= 0 and pl["R_s"] > 0 and pl["world"] == 1
    assert [row["gpus"] for row in pl["rows"]][-1] == LLAMA3_GPUS
    assert "**16,384**" in md


def test_planner_scale_across_gpus() -> None:
    rows = planner_scale(0.05, 60.0, 0.5)
    taus, wastes = [r["interval_s"] for r in rows], [r["waste"] for r in rows]
    assert all(a > b for a, b in itertools.pairwise(taus))
    assert all(a < b for a, b in itertools.pairwise(wastes))
    (llama,) = [r for r in rows if r["llama3"]]
    assert llama["gpus"] == 16384 and llama["job_mtbf_s"] / 3600 == pytest.approx(3.09, abs=0.01)
    for r in rows:
        parts = r["waste_parts"]
        assert r["waste"] == pytest.approx(parts["ckpt"] + parts["rework"] + parts["restart"])
        assert parts["ckpt"] == pytest.approx(0.05 / r["interval_s"])
        assert parts["restart"] == pytest.approx(60.0 / r["job_mtbf_s"])


def test_fit_line_recovers_a_line() -> None:
    f = fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
    assert f is not None
    assert (f["intercept"], f["slope"], f["r2"]) == pytest.approx((1.0, 2.0, 1.0))
    assert fit_line([1.0, 1.0], [2.0, 3.0]) is None


def test_bad_input_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least one total state size"):
        measure_sweep(tmp_path, sizes=(), worlds=(1,))
    with pytest.raises(ConfigError, match="below 1 MiB"):
        measure_sweep(tmp_path, sizes=(512 << 10,), worlds=(1,))
    with pytest.raises(ConfigError, match="between 1 and 8"):
        measure_sweep(tmp_path, sizes=(MiB,), worlds=(0,))
    with pytest.raises(ConfigError, match="--sizes: '512KiB' is not a size of at least 1 MiB"):
        parse_sizes("64MiB,512KiB")
    with pytest.raises(ConfigError, match="at least one GPU count"):
        planner_scale(0.05, 60.0, gpus=())
    assert not list(tmp_path.iterdir()), "nothing runs on bad input"


def test_cli_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--sweep", "--sizes", "512KiB"]) == 2
    assert "--sizes" in capsys.readouterr().err
    assert bench_main(["--sizes", "64MiB"]) == 2
    assert "--sizes is for --sweep" in capsys.readouterr().err


def test_a_point_that_does_not_fit_says_why(tmp_path: Path) -> None:
    reason = room_for(1 << 50, 1, tmp_path)
    assert reason is not None and "GiB of RAM" in reason and "available" in reason
