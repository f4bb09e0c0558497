"""bench/tier2_servers.py end to end at 2 MiB on servers it starts itself (SeaweedFS, moto,
fake-gcs-server, Azurite): the section's shape, that every client moved the file, that
the ratios are ours ÷ the best other client, the table, the targets and the standalone
entry — never speed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench import tier2_clients as tc
from bench.report import render_markdown
from bench.targets import evaluate
from bench.tier2_servers import STORES, main, markdown, measure, server_missing
from tests._require import require

# starts four servers (~15 s): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.slow

MiB = 1 << 20
OURS = {"seaweedfs": "tierckpt S3Storage", "moto": "tierckpt S3Storage",
        "fake_gcs": "tierckpt GCSStorage", "azurite": "tierckpt AzureStorage"}
SDK = {"seaweedfs": "boto3", "moto": "boto3", "fake_gcs": "google-cloud-storage",
       "azurite": "azure-storage-blob"}


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    for kind in STORES:
        why = server_missing(kind)
        require(why is None, f"{kind}: {why}")
    require(tc.obstore_missing() is None, str(tc.obstore_missing()))
    work = tmp_path_factory.mktemp("tier2-servers")
    s = measure(work / "w", mib=2, rounds=2)
    assert not list((work / "w").iterdir()), "the section left files behind"
    return s


@pytest.mark.parametrize("kind", STORES)
def test_every_client_moved_the_file(section: dict[str, Any], kind: str) -> None:
    s = section[kind]
    assert list(s["clients"]) == [OURS[kind], SDK[kind], "obstore"]
    for name, c in s["clients"].items():
        assert len(c["download_s"]) == 2 and c["download_MiB_s"] == pytest.approx(
            2 / statistics.median(c["download_s"])), name
        if kind == "fake_gcs" and name == "obstore":  # it reads the SDK's object
            assert "invalid uploadType" in c["no_upload"] and c["upload_s"] == []
            assert c["upload_MiB_s"] is None
        else:
            assert len(c["upload_s"]) == 2 and c["upload_MiB_s"] > 0, name


@pytest.mark.parametrize("kind", STORES)
def test_ratio_is_ours_over_the_best_other(section: dict[str, Any], kind: str) -> None:
    s = section[kind]
    for key in ("upload", "download"):
        others = {n: c[f"{key}_MiB_s"] for n, c in s["clients"].items()
                  if n != OURS[kind] and c[f"{key}_MiB_s"]}
        best = max(others, key=lambda n: others[n])
        assert s[key]["best"] == best
        assert s[key]["ratio_vs_best"] == pytest.approx(
            s["clients"][OURS[kind]][f"{key}_MiB_s"] / others[best])


def test_ours_runs_in_the_probed_modes(section: dict[str, Any]) -> None:
    assert section["seaweedfs"]["integrity"] == "crc32c"
    assert section["moto"]["integrity"] == "md5"
    assert section["fake_gcs"]["ours_options"]["integrity"] == section["fake_gcs"]["integrity"]
    for kind in STORES:
        assert section[kind]["ours_options"]["max_concurrency"] == tc.CONCURRENCY
    assert section["mib"] == 2 and section["part_bytes"] == tc.PART


def test_markdown_targets_and_report(section: dict[str, Any]) -> None:
    md = "\n".join(markdown(section))
    assert "## Tier-2 clients" in md and md.count("**ours ÷ best other**") == len(STORES)
    assert "cannot (see JSON)" in md
    assert "Skipped: x" in "\n".join(markdown({"skipped": "x"}))
    rows = [t for t in evaluate({}, {}, {"tier2_servers": section})
            if t.goal in ("store_upload", "store_fetch")]
    assert len(rows) == 2 * len(STORES)
    for t in rows:
        kind = next(k for k in STORES if section[k]["label"] == t.subject)
        key = "upload" if t.goal == "store_upload" else "download"
        assert t.world == 0 and t.ratio == section[kind][key]["ratio_vs_best"]
        assert t.ratio is not None and t.met == (t.ratio >= 0.9)
    skipped = evaluate({}, {}, {"tier2_servers": {"skipped": "--quick"}})
    assert all(t.met is None and t.note == "--quick" for t in skipped
               if t.goal.startswith("store_"))
    r = {"started": "2026-01-01T00:00:00Z", "wall_seconds": 1.0, "limits": {}, "worlds": {},
         "config": {"size_bytes": MiB, "worlds": [1], "repeats": 1, "saves": 2, "quick": False},
         "machine": {"cores": 2, "cores_usable": 2, "cpu_model": "x", "mem_total_bytes": 1,
                     "target_fs": "t", "target_device": "t", "target_mount": "/t",
                     "loadavg_start": [0.1], "torch": "t", "python": "p", "kernel": "k"},
         "tier2_servers": section, "targets": []}
    assert "## Tier-2 clients" in render_markdown(r)


def test_standalone_entry_writes_json(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    require(server_missing("fake_gcs") is None, "fake-gcs-server is missing")
    assert main(["--quick", "--stores", "fake_gcs", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GCS on fake-gcs-server" in out and "| S3 on moto | skipped: not asked for" in out
    (written,) = tmp_path.glob("tier2-servers-*.json")
    doc = json.loads(written.read_text())
    assert doc["mib"] == 2 and doc["rounds"] == 1 and doc["moto"] == {"skipped": "not asked for"}
    with pytest.raises(SystemExit):
        main(["--stores", "ceph"])
