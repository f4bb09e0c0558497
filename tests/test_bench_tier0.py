"""bench/tier0.py end to end at 8 MiB on the session's SeaweedFS: the section's shape, where
each restore's bytes came from, and that it cleans up after itself — never speed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from s3server import S3Env

from bench.tier0 import SHM, SHM_PREFIX, main, markdown, measure_tier0
from tests._bench_tier2 import server_env

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

MiB = 1 << 20
PREFIX = "t-tier0"


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(SHM_PREFIX)}


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> dict[str, Any]:
    before = _ours()
    with server_env(s3_server, PREFIX) as url:
        out = measure_tier0(tmp_path_factory.mktemp("tier0"), 8 * MiB, url=url, repeats=1)
    out["_shm_new"] = sorted(_ours() - before)
    return out


def _timed(m: dict[str, Any]) -> None:
    assert m["seconds"] > 0 and m["bytes"] > 0 and m["gbps"] > 0, m
    assert m["seconds"] == min(m["runs"])


@pytest.mark.slow
def test_restores_name_their_source(section: dict[str, Any]) -> None:
    rs = section["restores"]
    assert section["server"] == "given"
    for source, limit in (("tier0", "copy_2threads"), ("tier1", "cold_read"),
                          ("tier2", "plain_download")):
        r = rs[source]
        _timed(r)
        assert r["source"] == source and r["sources"] == [source], r
        assert r["limit"] == limit and r["ratio_vs_limit"] > 0
        assert r["bytes"] == section["checkpoint_bytes"] >= section["bytes"] > 0
        assert r["open_seconds"] > 0 and r["info_seconds"] > 0
    assert rs["tier0"]["bytes_by_source"]["tier0"] > 0
    assert rs["tier1"]["bytes_by_source"] == {"tier0": 0, "tier0-peer": 0,
                                              "tier1": rs["tier1"]["bytes_by_source"]["tier1"],
                                              "tier2": 0}
    assert rs["tier1"]["bytes_by_source"]["tier1"] > 0 and "cold" in rs["tier1"]
    assert rs["tier2"]["bytes_by_source"]["tier2"] > 0
    for key in ("copy_2threads", "cold_read", "plain_download"):
        _timed(section["limits"][key])
    assert section["limits"]["plain_download"]["bytes"] == section["checkpoint_bytes"]


def test_saves_and_plan(section: dict[str, Any]) -> None:
    sv = section["saves"]
    assert (sv["tier0_ram"]["tier"], sv["tier0_tier1"]["tier"], sv["tier0_off"]["tier"]) == \
        ("tier0", "tier1", "tier1")
    for kind in sv.values():
        for key in ("blocking", "durable", "background"):
            _timed(kind[key])
        assert kind["durable"]["seconds"] > kind["blocking"]["seconds"]
    assert section["C_tier0_vs_off"] > 0 and section["W_ram_vs_tier1"] > 0
    assert section["restart"]["seconds"] > 0 and section["upload"]["bytes"] > 0
    p = section["plan"]
    assert p["nodes"] == 64 and p["job_mtbf_s"] == pytest.approx(32 * 86400 / 64)
    for name, save, restore in (("tier0", "tier0_ram", "tier0"), ("tier1", "tier0_off", "tier1")):
        q = p[name]
        assert q["C_s"] == sv[save]["blocking"]["seconds"]
        assert q["W_s"] == sv[save]["background"]["seconds"]
        assert q["R_s"] > section["restores"][restore]["seconds"]
        assert q["interval_s"] > 0 and 0 < q["waste"] < 1 and 0 < q["exact_waste"] < 1
    assert any("two nodes" in n for n in section["notes"])


def test_cleans_up_shm_and_tier2(section: dict[str, Any], s3_server: Any) -> None:
    assert section["tier0_dir"].startswith(f"{SHM}/{SHM_PREFIX}")
    assert not Path(section["tier0_dir"]).exists()
    assert section["_shm_new"] == [], "tier-0 directories left under /dev/shm"
    assert section["tier2_url"].startswith(f"s3://{s3_server.bucket}/{PREFIX}/")
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{PREFIX}/")
    assert "Contents" not in listed, "the section left objects on tier 2"


def test_markdown_rows(section: dict[str, Any]) -> None:
    md = "\n".join(markdown(section))
    for text in ("restore() from tier 0", "source `tier0`", "source `tier1`", "source `tier2`",
                 "× memcpy", "× cold read", "× plain download", "C: save()", "| tier0 |",
                 "| tier1 |", "two nodes"):
        assert text in md, text
    assert "Skipped" in "\n".join(markdown({"skipped": "--quick"}))


@pytest.mark.slow
def test_standalone_entry_prints_table_and_json(
        tmp_path: Path, s3_env: S3Env, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCKPT_BENCH_S3_URL", s3_env.url)
    before = _ours()
    assert main(["--mib", "2", "--repeats", "1", "--target", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table, _, doc = out.partition("\n{")
    assert "## Tier 0" in table
    assert json.loads("{" + doc)["restores"]["tier0"]["source"] == "tier0"
    assert not list(tmp_path.iterdir()), "work directory left behind"
    assert _ours() == before
