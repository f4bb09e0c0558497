"""The checkpoint commands on Google Cloud Storage and Azure Blob Storage, as on S3: one
journey per store on its emulator (fake-gcs-server, Azurite) — ``doctor`` probes it,
``upload`` copies each new step verified (in the integrity mode the probe chose), ``ls``
lists the steps on tier 2, ``verify --tier 2`` checks every byte, ``fetch`` brings a step
back bit-identical to a fresh node, and ``gc --tier2`` deletes what tier-2 retention no
longer keeps, every object of it. Synthetic checkpoints: no torch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import tierckpt.cli.doctor
import tierckpt.cli.fetch
import tierckpt.cli.gc
import tierckpt.cli.ls
import tierckpt.cli.upload
import tierckpt.cli.verify  # noqa: F401  (each registers its command)
from tests._synthetic import make_checkpoint
from tierckpt.format import layout
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

from ._helpers import invoke, invoke_json

FILES = {".metadata": (700, None), "__0_0.distcp": (40_000, 0), "__1_0.distcp": (30_000, 1)}


@pytest.fixture(params=["gcs", "azure"])
def store(request: pytest.FixtureRequest) -> tuple[str, Callable[[], list[str]]]:
    """The store's URL on its emulator and a listing of every object under its prefix
    (names relative to it; on Azure blobs of uncommitted blocks too)."""
    if request.param == "gcs":
        env = request.getfixturevalue("gcs_env")
        return env.url, env.names
    aenv = request.getfixturevalue("azure_env")
    return aenv.url, lambda: aenv.keys(uncommitted=True)


def test_the_checkpoint_commands_on_the_store(
        store: tuple[str, Callable[[], list[str]]], tmp_path: Path) -> None:
    url, names = store
    t1 = tmp_path / "t1"
    doctor = invoke_json("doctor", "--tier2", url)
    assert (doctor["integrity"], doctor["marker"]) == ("md5", "create-only")
    assert names() == []  # the probe's scratch objects are gone

    manifests = {}
    for step in (1, 2, 3):  # each new step uploaded as it comes, as a job's uploader does
        manifests[step] = make_checkpoint(t1, step, FILES, world_size=2)
        doc = invoke_json("upload", "--tier1", str(t1), "--tier2", url)
        assert [(r["step"], r["status"]) for r in doc["results"]] == [(step, "verified")]
        record = Tier1Catalog(t1).uploads.upload_record(step)
        assert record is not None and record["integrity"] == doctor["integrity"]

    listing = invoke_json("ls", "--tier1", str(t1), "--tier2", url)
    assert {r["step"]: r["state"] for r in listing["checkpoints"] if r["tier"] == 2} == {
        1: "verified", 2: "verified", 3: "verified"}
    assert listing["tier2_modes"]["integrity"] == "md5"

    m = manifests[3]
    check = invoke_json("verify", "3", "--tier", "2", "--tier2", url)
    assert check["ok"] is True and (check["files"], check["bytes"]) == (len(m.files),
                                                                         m.total_bytes)

    fresh = tmp_path / "replaced-node"
    fetched = invoke_json("fetch", "3", "--tier1", str(fresh), "--tier2", url)
    assert fetched["bytes_downloaded"] == m.total_bytes
    src, dst = t1 / layout.step_dirname(3), fresh / layout.step_dirname(3)
    for name in [f.name for f in m.files] + [layout.MANIFEST, layout.COMPLETE]:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name  # bit-identical

    args = ("gc", "--tier1", str(t1), "--tier2", url, "--keep-last", "3",
            "--tier2-keep-last", "1", "--tier2-keep-every", "0")
    assert invoke_json(*args)["tier2"] == {"delete": [1, 2], "keep": [3]}  # a dry run
    assert invoke_json(*args, "--yes")["applied"] is True
    with open_storage(url) as st:
        assert Tier2Catalog(st).complete_steps() == [3]
        kept = Tier2Catalog(st).resolve(3).objmap
    assert kept is not None
    rest = names()  # every object of steps 1 and 2, but the content step 3 still refers to
    assert sorted({n.split("/")[0] for n in rest}) == ["objects", "step-00000003"]
    assert {n for n in rest if n.startswith("objects/")} == set(kept.keys().values())
    assert Tier1Catalog(t1).complete_steps() == [3, 2, 1]  # --keep-last 3 kept tier 1 whole


def test_a_missing_bucket_or_container_exits_2(
        store: tuple[str, Callable[[], list[str]]]) -> None:
    url, _ = store
    scheme = url.split("://")[0]
    r = invoke("doctor", "--tier2", f"{scheme}://no-such-store-doctor/p")
    words = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "does not exist" in words, r.output
