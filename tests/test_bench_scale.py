"""bench/scale.py: a reduced ``--scale`` end to end (real gloo ranks at W = 1, 2, 4; synthetic
W = 16, 64 with few layers built) — every count present, an integer, positive; the tables
and the plot — and, with values alone, the synthetic state's shards, the layer scaling, the
audit of reads and the CLI's refusals. Structure only, never speed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.reads import Reads
from bench.run import main as bench_main
from bench.scale import SCHEMA, parse_world_list, run_scale
from bench.scale_state import LAYER, LAYERS, local_plan
from bench.scale_synth import synthetic_point
from tierckpt.errors import ConfigError


@pytest.fixture(scope="module")
def scale(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    base = tmp_path_factory.mktemp("scale")
    rc = run_scale(worlds="1,2,4", synthetic="16,64", out=base / "out",
                   target=base / "target", item_cap=64, label="test")
    assert rc == 0
    (json_path,) = (base / "out").glob("*-scale.json")
    (md_path,) = (base / "out").glob("*-scale.md")
    return json.loads(json_path.read_text()), md_path.read_text(), base


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


@pytest.mark.slow
def test_real_runs_count_every_operation(scale: tuple[dict[str, Any], str, Path]) -> None:
    r, _, base = scale
    assert r["schema"] == SCHEMA and r["errors"] == [] and r["code"]["label"] == "test"
    assert [p["world"] for p in r["real"]["points"]] == [1, 2, 4]
    own: dict[int, int] = {}
    others: dict[int, int] = {}
    for p in r["real"]["points"]:
        assert "skipped" not in p and p["commit_s"] >= 0
        for side, ops in (("tierckpt", ("save", "restore", "open")),
                          ("dcp", ("save", "restore"))):
            for op in ops:
                o = p[side][op]
                assert _count(o["collectives"]) and o["collectives"] == sum(
                    o["by_kind"].values()), (side, op, o)
                assert len(o["per_rank"]) == p["world"]
                assert all(_count(n) for n in o["by_kind"].values())
                if op == "open":
                    continue
                assert _count(o["coordinator_sent"]), (side, op, o)
                if p["world"] > 1:
                    assert _count(o["coordinator_received"]) and _count(o["other_received_max"])
                else:
                    assert o["other_received_max"] is None
            restore = p[side]["restore"]
            assert _count(restore["metadata_read_max"]) and _count(restore["shard_files_max"])
            assert restore["metadata_read_min"] <= restore["metadata_read_max"]
        assert ".metadata" in p["dcp"]["restore"]["metadata_read_by_file"]
        ours = p["tierckpt"]["restore"]
        by_file = ours["metadata_read_by_file"]
        # the saved layout: the rank's own metadata, never .metadata; the domain's owner
        # (rank 0) verified the checkpoint from its parts: no rank reads the manifest
        assert ".metadata" not in by_file, by_file
        assert "manifest.json" not in ours["metadata_read_owner_by_file"]
        assert "manifest.00000.json" in ours["metadata_read_owner_by_file"]
        own[p["world"]] = by_file[f"__{ours['metadata_read_rank']}.metadata"]
        if p["world"] > 1:  # the other ranks: their manifest part, not the manifest
            other = ours["metadata_read_other_by_file"]
            assert "manifest.00000.json" in other and "manifest.json" not in other, other
            others[p["world"]] = ours["metadata_read_other_max"]
    # what a rank plans from does not grow with W (its own chunks only)
    assert own[4] <= 1.25 * own[1], own
    assert others[4] <= 1.25 * others[2], others
    assert not list((base / "target").iterdir()), "the scale run left files behind"


@pytest.mark.slow
def test_synthetic_points_have_every_quantity(scale: tuple[dict[str, Any], str, Path]
                                              ) -> None:
    r, _, _ = scale
    s = r["synthetic"]
    assert s["tensors"] == LAYERS * len(LAYER) == 720
    assert [p["world"] for p in s["points"]] == [16, 64]
    first = s["points"][0]["rank_metadata_bytes"]
    for p in s["points"]:
        assert p["layers_built"] == 64 // p["world"] and p["scaled"]
        for key in ("coordinator_peak_bytes", "metadata_bytes", "manifest_bytes",
                    "restore_read_bytes_per_rank", "save_received_bytes_per_rank",
                    "gathered_plan_bytes", "file_list_bytes", "rank_metadata_bytes",
                    "rank_restore_read_bytes_per_rank", "records_bytes", "manifest_now_bytes",
                    "now_coordinator_peak_bytes", "now_received_bytes", "owner_received_bytes",
                    "now_owner_received_bytes", "marker_bytes", "part_bytes",
                    "part_restore_read_bytes_per_rank", "owner_restore_read_bytes_per_rank"):
            assert _count(p[key]), key
        # since the parts a rank reads its part and the marker, not the whole manifest;
        # an owner its domain's parts, the first (the header) and the marker again
        assert p["part_restore_read_bytes_per_rank"] < p["rank_restore_read_bytes_per_rank"]
        assert p["part_restore_read_bytes_per_rank"] < p["owner_restore_read_bytes_per_rank"] \
            < 2 * p["part_restore_read_bytes_per_rank"]
        assert p["manifest_owner_restore_read_bytes_per_rank"] == \
            p["part_restore_read_bytes_per_rank"] + p["manifest_now_bytes"]
        assert 0 < p["header_bytes"] < p["part_bytes"]
        assert p["part_bytes"] < 4096 and p["part_restore_seconds"] > 0
        # an owner holds the .metadata: a steady save sends it the manifest and a digest
        assert p["now_owner_received_bytes"] < p["metadata_bytes"] / 10
        assert p["owner_received_bytes"] > p["metadata_bytes"]
        assert p["restore_read_bytes_per_rank"] == p["metadata_bytes"] + p["manifest_bytes"]
        assert p["rank_restore_read_bytes_per_rank"] == \
            p["rank_metadata_bytes"] + p["manifest_now_bytes"]
        assert p["manifest_now_bytes"] < p["manifest_bytes"]  # no per-record CRC32Cs
        assert 0 < p["now_coordinator_seconds"] < p["dcp_coordinator_seconds"]
        assert p["replan_coordinator_seconds"] > 0
        assert p["seconds"]["now.validate"] == p["validate"]["ours_estimate_seconds"] > 0
        # a rank's own metadata: flat in W, a fraction of .metadata that shrinks as 1/W
        assert p["rank_metadata_bytes"] == pytest.approx(first, rel=0.1)
        assert p["rank_metadata_bytes"] < p["metadata_bytes"] / (p["world"] / 4)
        assert not p["validate"]["measured"]
        assert p["seconds"]["dcp.validate"] == p["validate"]["estimate_seconds"] > 0
        assert sum(v["keys"] for v in p["validate"]["per_shape"].values()) == 720 * 3
        assert all(v > 0 for v in p["seconds"].values())


@pytest.mark.slow
def test_tables_and_plot(scale: tuple[dict[str, Any], str, Path]) -> None:
    r, md, _ = scale
    png = Path(r["plot"])
    assert png.suffix == ".png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for heading in ("## Real gloo runs", "### Save", "### Restore", "### Collectives by kind",
                    "## Synthetic planning", "### Seconds by phase", "### Validation per"):
        assert heading in md
    rows = md.splitlines()
    for w in ("1", "2", "4"):
        assert sum(row.startswith(f"| {w} | ") for row in rows) >= 3  # save, restore, kinds
    assert sum(row.startswith("| 64 | ") for row in rows) == 3
    assert "**test**" in md


def test_synthetic_shards_cover_every_tensor_once() -> None:
    world = 3
    plans = [local_plan(r, world, 1) for r in range(world)]
    for name, shape in LAYER:
        chunks = [i.tensor_data.chunk for p in plans for i in p.items
                  if i.index.fqn == f"model.layers.0.{name}" and i.tensor_data is not None]
        assert len(chunks) == world
        assert sum(math.prod(c.sizes) for c in chunks) == math.prod(shape)
        assert [c.offsets[0] for c in chunks] == sorted(c.offsets[0] for c in chunks)
    per_rank = len(LAYER) * 4 + 12 + 1  # param, 2 moments, step; the group; the blob
    assert all(len(p.items) == per_rank for p in plans)


def test_ranks_past_the_rows_hold_an_empty_shard_at_the_end() -> None:
    plan = local_plan(1500, 4096, 1)  # wk has 1,024 rows
    (wk,) = [i for i in plan.items if i.index.fqn == "model.layers.0.attention.wk.weight"]
    assert wk.tensor_data is not None
    assert tuple(wk.tensor_data.chunk.sizes) == (0, 8192)
    assert tuple(wk.tensor_data.chunk.offsets) == (1024, 0)


@pytest.mark.slow  # 8 s: out of make test-fast (make test runs it)
def test_layer_scaling_matches_the_full_state() -> None:
    """Sizes scaled from 2 of the 80 layers are within 3 % of all 80 built (world 4)."""
    full, scaled = synthetic_point(4, item_cap=4 * LAYERS), synthetic_point(4, item_cap=8)
    assert not full["scaled"] and full["validate"]["measured"]
    assert scaled["scaled"] and scaled["layers_built"] == 2
    for key in ("metadata_bytes", "manifest_bytes", "gathered_plan_bytes", "file_list_bytes"):
        assert scaled[key] == pytest.approx(full[key], rel=0.03), key


def test_reads_records_files_opened_for_reading(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"m" * 100)
    (ckpt / "__0_0.distcp").write_bytes(b"d" * 1000)
    (tmp_path / "elsewhere").write_bytes(b"e")
    with Reads(tmp_path) as reads:
        for name in (".metadata", ".metadata", "__0_0.distcp"):
            with open(ckpt / name, "rb"):
                pass
        with open(ckpt / "new", "wb"):
            pass
    with open(ckpt / ".metadata", "rb"):  # after the block: not recorded
        pass
    assert reads.to_json() == {"metadata_bytes": 200, "by_file": {".metadata": 200},
                               "opens": 2, "shard_files": 1}


def test_cli_refuses_bad_worlds(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--scale", "--world", "0,2"]) == 2
    assert "--world" in capsys.readouterr().err
    assert bench_main(["--scale", "--synthetic-world", "x"]) == 2
    assert "--synthetic-world" in capsys.readouterr().err
    assert bench_main(["--synthetic-world", "16"]) == 2
    assert "are for --scale" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="between 1 and 8"):
        parse_world_list("9", "--world", 8)
