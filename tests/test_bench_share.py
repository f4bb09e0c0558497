"""bench/share.py end to end at 8 MiB on the session's SeaweedFS: the section's shape and
internal consistency, never speed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from s3server import S3Env

from bench.share import main, markdown, measure_share
from tests._bench_tier2 import server_env

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

MiB = 1 << 20
TIMED = ("load", "boto3_ranges", "boto3_coalesced", "boto3_whole", "export", "write_limit")


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> dict[str, Any]:
    with server_env(s3_server, "t-share") as url:
        return measure_share(tmp_path_factory.mktemp("share"), 8 * MiB, url=url, repeats=1)


@pytest.mark.slow
def test_section_fields_and_ratios(section: dict[str, Any], s3_server: Any) -> None:
    s = section
    assert s["server"] == "given" and s["url"].startswith("s3://tierckpt-test/t-share/")
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="t-share/")
    assert "Contents" not in listed, "the section left objects on tier 2"
    for key in TIMED:
        m = s[key]
        assert m["seconds"] > 0 and m["bytes"] > 0 and m["MB_s"] > 0, (key, m)
        assert m["seconds"] == min(m["runs"])
    ck = s["checkpoint"]
    # tier 2 is content-addressed: a small file whose bytes another holds is sent once
    assert ck["bytes"] == s["load"]["checkpoint_bytes"] >= ck["upload_bytes"] > 0
    # model ≈ 1/3 of model + AdamW: only its records (plus metadata) were read
    assert s["model_bytes"] < s["load"]["bytes"] < 0.5 * ck["bytes"]
    assert s["load"]["read_ratio"] == pytest.approx(s["load"]["bytes"] / ck["bytes"])
    assert s["load"]["read_ratio"] < 0.5 and s["load"]["verified"] == "chunks"
    assert s["boto3_ranges"]["bytes"] <= s["load"]["bytes"]  # same records, no metadata
    assert s["boto3_coalesced"]["bytes"] == s["boto3_ranges"]["bytes"]
    assert 1 <= s["boto3_coalesced"]["spans"] <= s["boto3_ranges"]["records"]
    assert s["boto3_whole"]["bytes"] > 2 * s["boto3_ranges"]["bytes"]
    for key in ("load_seconds_vs_boto3", "load_ratio_vs_boto3", "load_seconds_vs_coalesced",
                "load_seconds_vs_whole", "export_ratio_vs_write_limit"):
        assert s[key] > 0, key


def test_export_files_exist_and_ram_is_reported(section: dict[str, Any]) -> None:
    e, ram = section["export"], section["export_ram"]
    out = Path(e["out_dir"])
    assert e["shards"] >= 2 and e["bytes"] == section["model_bytes"]
    for f in e["files"]:
        assert (out / f["name"]).stat().st_size == f["size"] > 0
    shards = [f["size"] for f in e["files"] if f["name"].endswith(".safetensors")]
    assert len(shards) == e["shards"] and ram["largest_shard_bytes"] == max(shards)
    assert ram["peak_growth_bytes"] > 0 and ram["method"] in {"clear_refs", "vmhwm_unreset"}
    assert ram["ratio_vs_largest_shard"] == pytest.approx(
        ram["peak_growth_bytes"] / ram["largest_shard_bytes"])
    assert 0 < ram["largest_tensor_bytes"] <= ram["largest_shard_bytes"]
    assert ram["library_peak_tensor_bytes"] >= ram["largest_tensor_bytes"]


def test_markdown_rows(section: dict[str, Any]) -> None:
    md = "\n".join(markdown(section))
    assert "`load(url, model)`" in md and "`export(tier1)`" in md and "peak RSS" in md
    assert md.count("\n|") >= 7
    assert "Skipped" in "\n".join(markdown({"skipped": "--quick"}))


@pytest.mark.slow
def test_standalone_entry_prints_table_and_json(
        tmp_path: Path, s3_env: S3Env, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCKPT_BENCH_S3_URL", s3_env.url)
    assert main(["--mib", "4", "--repeats", "1", "--target", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table, _, doc = out.partition("\n{")
    assert "## Sharing readers" in table
    assert json.loads("{" + doc)["load"]["read_ratio"] < 0.5
    assert not list(tmp_path.iterdir()), "work directory left behind"
