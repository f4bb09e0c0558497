"""bench/transfer.py end to end at 16 MiB on the session's SeaweedFS: the section's shape,
that the bytes moved are the checkpoint's, verified and complete, that it cleans up after
itself, and that the targets read it — never speed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from s3server import S3Env

from bench.config import BenchConfig
from bench.report import render_markdown
from bench.targets import evaluate
from bench.transfer import STEP, main, markdown, measure_transfer
from tests._bench_tier2 import server_env
from tierckpt.format import layout
from tierckpt.tier1.catalog import Tier1Catalog

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

MiB = 1 << 20
PREFIX = "t-transfer"
TIMED = ("tierckpt_upload", "boto3_upload", "tierckpt_download", "boto3_download")


def _cfg(tmp: Path, mib: int, *, quick: bool = False) -> BenchConfig:
    return BenchConfig(size_bytes=mib * MiB, quick=quick, worlds=(1,), out_dir=tmp,
                       target_dir=tmp, repeats=1, saves=2, loop_seconds=0.3)


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> dict[str, Any]:
    with server_env(s3_server, PREFIX) as url:
        work = tmp_path_factory.mktemp("transfer")
        return measure_transfer(_cfg(work, 16), work / "section", endpoint=url)


def test_transfers_move_the_checkpoint_bytes(section: dict[str, Any]) -> None:
    s, ck = section, section["checkpoint"]
    assert s["server"] == "given" and s["step"] == STEP
    root = Path(ck["root"])
    sizes = {p.name: p.stat().st_size for p in (root / layout.step_dirname(STEP)).iterdir()
             if p.name in ck["files"]}
    assert sizes == ck["files"] and ck["bytes"] == sum(sizes.values()) > 16 * MiB
    for key in TIMED:
        m = s[key]
        assert m["bytes"] == ck["bytes"] and m["seconds"] == min(m["runs"]) > 0, (key, m)
        assert m["gbps"] == pytest.approx(m["bytes"] / m["seconds"] / 1e9)
    for kind in ("upload", "download"):
        ratio = s[f"tierckpt_{kind}"]["ratio_vs_boto3"]
        assert ratio > 0 and ratio == pytest.approx(
            s[f"tierckpt_{kind}"]["gbps"] / s[f"boto3_{kind}"]["gbps"])
        assert "nothing verified" in s[f"boto3_{kind}"]["reference"]


def test_upload_is_complete_and_download_identical(section: dict[str, Any]) -> None:
    ck, up, down = section["checkpoint"], section["tierckpt_upload"], section["tierckpt_download"]
    # every shard's bytes are sent; a small file whose bytes another file of the step holds
    # (DCP's metadata, once per rank at world 1) is stored once on tier 2 (content-addressed)
    shards = sum(size for name, size in ck["files"].items() if name.endswith(".distcp"))
    assert up["status"] == "verified" and shards <= up["uploaded_bytes"] <= ck["bytes"]
    assert up["complete"] is True  # the marker vouches for the tier-1 manifest
    assert {n: up["objects"][n] for n in ck["files"]} == ck["files"]
    assert {layout.MANIFEST, layout.COMPLETE} <= up["objects"].keys()
    assert down["verified"] == "crc32c" and down["committed"] is True
    assert down["downloaded_bytes"] == ck["bytes"]
    src = Path(ck["root"]) / layout.step_dirname(STEP)
    dst = Path(down["root"]) / layout.step_dirname(STEP)
    assert Tier1Catalog(down["root"]).complete_steps() == [STEP]
    for name in [*ck["files"], layout.MANIFEST]:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name


def test_a_given_server_is_not_evicted_a_local_one_is_before_each_download(
        section: dict[str, Any], tmp_path: Path) -> None:
    from bench.transfer import _timed_all

    assert section["server_cache"]["evicted"].startswith("no (a given server")
    data = tmp_path / "server" / "volume.dat"
    data.parent.mkdir()
    data.write_bytes(b"x" * (4 * MiB))

    calls: list[str] = []

    class Ops:  # the order and the evictions are what is checked here, not the transfers
        def __getattr__(self, name: str) -> Any:
            return lambda: calls.append(name) or 0.0

    runs, evictions = _timed_all(Ops(), 2, data.parent)  # type: ignore[arg-type]
    assert calls == ["tierckpt_upload", "boto3_upload", "tierckpt_download",
                         "boto3_download", "boto3_upload", "tierckpt_upload",
                         "boto3_download", "tierckpt_download"]
    assert len(evictions) == 4 and all(e["honoured"] for e in evictions), evictions
    assert all(len(v) == 2 for v in runs.values())


def test_throughput_while_uploading(section: dict[str, Any]) -> None:
    t = section["throughput_uploading"]
    assert t["idle_steps_s"] > 0 and t["during_steps_s"] > 0
    assert t["ratio"] == pytest.approx(t["during_steps_s"] / t["idle_steps_s"])
    (w,) = t["windows"]
    assert w["window_s"] > 0 and w["upload_s"] > 0 and w["uploader_cpu_s"] >= 0


def test_cleans_up_tier2(section: dict[str, Any], s3_server: Any) -> None:
    assert section["url"].startswith(f"s3://{s3_server.bucket}/{PREFIX}/bench-transfer-")
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{PREFIX}/")
    assert "Contents" not in listed, "the section left objects on tier 2"


def test_targets_evaluate_the_section(section: dict[str, Any]) -> None:
    rows = evaluate({}, {}, {"transfer": section})
    by = {t.goal: t for t in rows}
    for goal, entry in (("upload", "tierckpt_upload"), ("download", "tierckpt_download")):
        assert by[goal].world == 0 and by[goal].met in (True, False)
        assert by[goal].ratio == section[entry]["ratio_vs_boto3"]
    t = by["upload_throughput"]
    assert t.met in (True, False) and t.ratio == section["throughput_uploading"]["ratio"]


def test_markdown_rows(section: dict[str, Any]) -> None:
    md = "\n".join(markdown(section))
    for text in ("## Tier-2 transfer", "upload: tierckpt uploader", "boto3 `upload_file`",
                 "download: tierckpt fetch", "boto3 `download_file`", "while the uploader"):
        assert text in md, text
    assert md.count("\n|") >= 8
    assert "Skipped" in "\n".join(markdown({"skipped": "--quick"}))


def test_report_renders_the_section(section: dict[str, Any]) -> None:
    r = {"started": "2026-01-01T00:00:00Z", "wall_seconds": 1.0, "limits": {}, "worlds": {},
         "config": {"size_bytes": MiB, "worlds": [1], "repeats": 1, "saves": 2, "quick": False},
         "machine": {"cores": 2, "cores_usable": 2, "cpu_model": "x", "mem_total_bytes": 1,
                     "target_fs": "t", "target_device": "t", "target_mount": "/t",
                     "loadavg_start": [0.1], "torch": "t", "python": "p", "kernel": "k"},
         "transfer": section, "targets": []}
    assert "upload: tierckpt uploader" in render_markdown(r)


def test_quick_skips(tmp_path: Path) -> None:
    s = measure_transfer(_cfg(tmp_path, 1, quick=True), tmp_path / "w")
    assert "--quick" in s["skipped"] and not (tmp_path / "w").exists()


@pytest.mark.slow
def test_standalone_entry_prints_table_and_json(
        tmp_path: Path, s3_env: S3Env, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCKPT_BENCH_S3_URL", s3_env.url)
    assert main(["--mib", "8", "--repeats", "1", "--target", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table, _, doc = out.partition("\n{")
    assert "## Tier-2 transfer" in table
    assert json.loads("{" + doc)["tierckpt_upload"]["status"] == "verified"
    assert not list(tmp_path.iterdir()), "work directory left behind"
    assert s3_env.keys() == [], "the entry left objects on tier 2"
