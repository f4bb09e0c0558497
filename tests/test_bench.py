"""`make bench`: the quick run end to end (real ranks, files, fsync) and the pure parts.

Asserts the results' shape and internal consistency, never speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.config import parse_size, parse_worlds
from bench.pagecache import evict, resident_fraction
from bench.report import SCHEMA
from bench.run import main
from bench.state import make_specs, shard_specs
from bench.targets import GOALS, evaluate
from tierckpt.errors import ConfigError

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MEASUREMENT_KEYS = {"seconds", "bytes", "gbps", "runs"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    base = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(base / "out"),
         "--target", str(base / "target")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (json_path,) = (base / "out").glob("*.json")
    (md_path,) = (base / "out").glob("*.md")
    assert json_path.stem == md_path.stem
    return json.loads(json_path.read_text()), md_path.read_text(), base


def _is_measurement(m: dict[str, Any], nbytes: int) -> None:
    assert m.keys() >= MEASUREMENT_KEYS, m
    assert m["seconds"] > 0 and m["bytes"] >= nbytes and m["seconds"] == min(m["runs"])
    assert m["gbps"] == pytest.approx(m["bytes"] / m["seconds"] / 1e9)


@pytest.mark.slow
def test_quick_results_schema(quick: tuple[dict[str, Any], str, Path]) -> None:
    r, md, base = quick
    assert r["schema"] == SCHEMA and r["errors"] == []
    size = r["config"]["size_bytes"]
    assert r["config"]["quick"] is True and r["config"]["worlds"] == [1]
    m = r["machine"]
    assert m["cores"] >= 1 and m["target_fs"] and isinstance(m["fsync"]["honoured"], bool)
    assert m["cache_drop"]["method"] in {"fadvise", "drop_caches", "none"}
    for key in ("copy_2threads", "write_buffered_fsync", "cold_read"):
        _is_measurement(r["limits"][key], size)
    assert r["limits"]["cold_read"]["cold"] == m["cache_drop"]["honoured"]
    dcp = r["worlds"]["1"]["dcp"]
    for key in ("async_default_blocking", "async_stager_blocking", "async_default_durable",
                "save_t1", "save_t4", "torch_save_rank0", "load_cold"):
        _is_measurement(dcp[key], size)
    assert dcp["throughput"]["idle_steps_s"] > 0 and dcp["throughput"]["ratio"] >= 0
    assert len(dcp["ram_thread"]["after_each_bytes"][0]) == r["config"]["saves"]
    assert "skipped" in dcp["ram_process"]  # --quick skips the per-rank daemon
    assert "skipped" in r["transfer"]
    # tierckpt is importable in this repo, so its section must have been measured
    tk = r["worlds"]["1"]["tierckpt"]
    assert "skipped" not in tk, tk
    for key in ("blocking", "durable", "restore_cold", "own_files_read", "copy_inline"):
        _is_measurement(tk[key], size)
    # C beside the copy run in the same ranks: one per timed save, and the ratio of the two
    assert len(tk["copy_inline"]["runs"]) == len(tk["blocking"]["runs"])
    assert tk["blocking"]["vs_copy_inline"] == pytest.approx(
        tk["blocking"]["seconds"] / tk["copy_inline"]["seconds"])
    assert "÷ the copy beside it" in md
    assert "own shard files" in md
    assert tk["restore_cold"]["bytes_read"] >= size
    assert "skipped" in r["model_state"]  # --quick: tests/test_bench_model_state.py runs it
    assert not list((base / "target").glob("bench-*")), "checkpoint files left behind"


def test_quick_targets_consistent(quick: tuple[dict[str, Any], str, Path]) -> None:
    r, md, _ = quick
    rows = r["targets"]
    assert {t["goal"] for t in rows} == {g.key for g in GOALS}
    for t in rows:
        if t["ratio"] is None:
            assert t["met"] is None and t["note"]
        elif t["op"] == "<=" and not t["note"].startswith("grew"):
            assert t["met"] == (t["ratio"] <= t["threshold"])
        elif t["op"] == ">=":
            assert t["met"] == (t["ratio"] >= t["threshold"])
    blocking = next(t for t in rows if t["goal"] == "blocking" and t["world"] == 1
                    and t["subject"] == "dcp.async_save default")
    expected = (r["worlds"]["1"]["dcp"]["async_default_blocking"]["seconds"]
                / r["limits"]["copy_2threads"]["seconds"])
    assert blocking["ratio"] == pytest.approx(expected)
    assert "## Targets" in md and "## Limits" in md and "## World size 1" in md
    assert md.count("| 1 |") >= sum(1 for t in rows if t["world"] == 1)


def test_bad_size_exits_2_naming_the_flag(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--size", "lots", "--out", str(tmp_path)]) == 2
    assert "--size" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_parse_size_and_worlds() -> None:
    assert parse_size("1GiB") == 1 << 30 and parse_size("64M") == 64 << 20
    assert parse_worlds("1,2,2") == (1, 2)
    for bad in ("12 parsecs", "10", "-1GiB"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    with pytest.raises(ConfigError, match="--world"):
        parse_worlds("0,2")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_partition_the_state(world: int) -> None:
    specs = make_specs(64 << 20)
    shards = [shard_specs(specs, r, world) for r in range(world)]
    names = [s.name for shard in shards for s in shard]
    assert sorted(names) == sorted(s.name for s in specs)  # every tensor exactly once
    loads = [sum(s.nbytes for s in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(s.nbytes for s in specs)
    assert len({s.name for s in specs}) == len(specs)


def test_evict_reports_what_happened(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    path.read_bytes()
    ev = evict([path])
    assert ev.resident_after == pytest.approx(resident_fraction([path]), abs=0.05)
    assert ev.honoured == (ev.method != "none")
    assert ev.honoured == (ev.resident_after <= 0.05)


def _m(seconds: float, nbytes: int = 10**9) -> dict[str, Any]:
    return {"seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9}


def test_evaluate_targets_from_values() -> None:
    limits = {"copy_2threads": _m(0.1), "write_odirect_fsync": _m(1.0), "cold_read": _m(1.0)}
    dcp = {"async_default_blocking": _m(0.31), "save_t1": _m(3.0), "load_cold": _m(1.2),
           "throughput": {"ratio": 0.4}, "ram_thread": {"ratio": 1.0, "growth_ratio": 0.3}}
    tk = {"blocking": _m(0.11), "durable": _m(1.05), "restore_cold": {**_m(1.0), "cold": False},
          "throughput": {"ratio": 0.85}, "ram": {"ratio": 0.99, "growth_ratio": 0.0}}
    rows = evaluate(limits, {1: {"dcp": dcp, "tierckpt": tk}},
                    {"transfer": {"skipped": "no server"}})
    by = {(t.goal, t.subject): t for t in rows}
    c = by[("blocking", "tierckpt save()")]
    assert c.ratio == pytest.approx(1.1) and c.met and c.vs_dcp == pytest.approx(0.11 / 0.31)
    assert by[("blocking", "dcp.async_save default")].met is False
    assert by[("durable", "tierckpt save() → committed")].met is True
    restore = by[("restore", "tierckpt restore()")]
    assert restore.met is True and "warm" in restore.note
    assert by[("ram", "dcp.async_save thread mode")].met is False  # 1.0× but grew 30 %
    assert by[("ram", "tierckpt save()")].met is True
    missing = by[("blocking", "dcp.async_save + reused DefaultStager")]
    assert missing.met is None and missing.ratio is None
    upload = by[("upload", "tierckpt upload")]
    assert upload.world == 0 and upload.met is None and upload.note == "no server"


def test_markdown_says_why_a_section_was_skipped(tmp_path: Path) -> None:
    from bench.report import render_markdown, write_results

    limits = {"copy_2threads": {**_m(0.1), "runs": [0.1]},
              "write_odirect_fsync": {**_m(0.0001), "seconds": 0.0, "gbps": 0.0,
                                      "note": "O_DIRECT refused: EINVAL"},
              "cold_read": {**_m(1.0), "cold": False}}
    dcp = {"async_default_blocking": _m(0.3), "save_t1": _m(2.0)}
    worlds = {"1": {"dcp": dcp, "tierckpt": {"skipped": "tierckpt has no CheckpointManager yet"}}}
    rows = evaluate(limits, {1: worlds["1"]}, {"transfer": {"skipped": "no server"}})
    r = {"schema": SCHEMA, "started": "2026-01-01T00:00:00Z", "wall_seconds": 1.0,
         "config": {"size_bytes": 1 << 20, "worlds": [1], "repeats": 1, "saves": 2,
                    "quick": True},
         "machine": {"cores": 2, "cores_usable": 2, "cpu_model": "x", "mem_total_bytes": 1 << 30,
                     "target_fs": "tmpfs", "target_device": "tmpfs", "target_mount": "/t",
                     "loadavg_start": [0.1], "loadavg_end": [0.2], "torch": "t",
                     "python": "p", "kernel": "k", "fsync": {"honoured": False},
                     "cache_drop": {"method": "none", "honoured": False}},
         "limits": limits, "worlds": worlds, "transfer": {"skipped": "no server"},
         "targets": [t.to_json() for t in rows]}
    md = render_markdown(r)
    assert "**tierckpt skipped:** tierckpt has no CheckpointManager yet" in md
    assert "O_DIRECT refused: EINVAL" in md and "not cold" in md
    assert "| fsync honoured | NO" in md and "| page cache dropped | NO" in md
    durable = next(t for t in rows
                   if t.goal == "durable" and t.subject == "dcp.save thread_count=1")
    assert durable.met is None  # no O_DIRECT limit: n/a, not missed
    json_path, md_path = write_results(r, tmp_path / "res", "stamp")
    assert json.loads(json_path.read_text())["targets"] == r["targets"]
    assert md_path.read_text() == md


def test_a_world_is_held_to_the_concurrent_cold_read(tmp_path: Path) -> None:
    """World 2's ranks share the disk: its restore is compared with two readers at once,
    world 1's with one; the concurrent limit really reads the whole file."""
    from bench.limits import concurrent_cold_read_limit

    limits = {"cold_read": _m(1.0), "cold_read_x2": _m(0.5)}  # two readers: 2 GB/s
    worlds = {w: {"tierckpt": {"restore_cold": _m(1.0)}} for w in (1, 2)}
    ratio = {t.world: t.ratio for t in evaluate(limits, worlds) if t.goal == "restore"
             and t.subject == "tierckpt restore()"}
    assert ratio[1] == pytest.approx(1.0) and ratio[2] == pytest.approx(0.5)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 << 20))
    m = concurrent_cold_read_limit(path, 2, repeats=1)
    assert m.bytes == 3 << 20 and m.seconds > 0
