"""``tierckpt verify``: full CRC32C of a real checkpoint on tier 1, a file:// tier 2 and a
real S3 server (SeaweedFS); one flipped byte is found and named."""

from __future__ import annotations

from pathlib import Path

import pytest
from s3server import S3Env

import tierckpt.cli.ls
import tierckpt.cli.verify  # noqa: F401  (register the commands)
from tierckpt.errors import MissingFilesError
from tierckpt.format import layout
from tierckpt.restore.verify import verify_checkpoint
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage, open_storage

from ._checkpoints import (
    clone,
    flip_byte,
    manifest,
    node_local_checkpoint,
    shard,
    upload,
)
from ._helpers import assert_full_bar, flags, invoke, invoke_json


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def test_tier1_ok_then_a_flipped_byte_is_named(template: Path, tmp_path: Path) -> None:
    t1 = clone(template, tmp_path / "t1")
    m = manifest(t1, 2)
    doc = invoke_json("verify", "2", "--tier1", str(t1))
    assert doc["ok"] is True and doc["tier"] == 1 and doc["step"] == 2
    assert doc["files"] == len(m.files) and doc["bytes"] == m.total_bytes
    assert doc["error"] is None and doc["elsewhere"] == []
    result = invoke("verify", "2", "--tier1", str(t1))
    assert result.exit_code == 0 and "ok" in result.stdout

    bad = shard(t1, 2)
    flip_byte(bad)
    result = invoke("verify", "2", "--tier", "1", "--tier1", str(t1))
    assert result.exit_code == 1
    assert bad.name in result.stderr and "CRC32C" in result.stderr
    doc_bad = invoke("verify", "2", "--tier1", str(t1), "--json")
    assert doc_bad.exit_code == 1
    assert '"ok": false' in doc_bad.stdout and bad.name in doc_bad.stdout
    # the other checkpoints are untouched, and verify moved nothing aside
    assert invoke("verify", "3", "--tier1", str(t1)).exit_code == 0
    assert bad.exists() and not (t1 / layout.QUARANTINE).exists()


def test_a_damaged_manifest_is_reported_and_said_to_be_restorable(
        template: Path, tmp_path: Path) -> None:
    """The parts rebuild a damaged ``manifest.json`` (a restore loses nothing), yet verify
    names the damaged file; with a part damaged too, only the damage is said."""
    t1 = clone(template, tmp_path / "t1")
    d = t1 / layout.step_dirname(2)
    flip_byte(d / layout.MANIFEST)
    result = invoke("verify", "2", "--tier1", str(t1))
    assert result.exit_code == 1, result.output
    said = _flat(result.stderr)
    assert "manifest.json" in said and "a restore loses nothing" in said
    flip_byte(d / layout.part_filename(0))
    said = _flat(invoke("verify", "2", "--tier1", str(t1)).stderr)
    assert "manifest.json" in said and "loses nothing" not in said


def test_tier1_missing_step_and_files(template: Path, tmp_path: Path) -> None:
    t1 = clone(template, tmp_path / "t1")
    result = invoke("verify", "9", "--tier1", str(t1))
    assert result.exit_code == 1 and "no checkpoint step-00000009" in result.stderr
    shard(t1, 1).unlink()
    result = invoke("verify", "1", "--tier1", str(t1))
    assert result.exit_code == 1 and "missing" in result.stderr


def test_node_local_files_held_elsewhere_are_reported_not_failed(tmp_path: Path) -> None:
    """A node's tier 1 holds only its ranks' shards: the rest is other nodes', not damage."""
    t1 = tmp_path / "t1"
    node_local_checkpoint(t1, 4, {".metadata": (300, None), "__0_0.distcp": (5000, 0),
                            "__1_0.distcp": (6000, 1)},
                    domains=((0,), (1,)), world_size=2, only_ranks={0})
    with pytest.raises(MissingFilesError):  # the library's view: fetchable, not corrupt
        verify_checkpoint(t1 / "step-00000004", full=True)
    doc = invoke_json("verify", "4", "--tier1", str(t1))
    assert doc["ok"] is True and doc["elsewhere"] == ["__1_0.distcp"]
    assert doc["files"] == 2 and doc["bytes"] == 5300


def test_tier2_file_url_ok_then_corrupt_object(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    upload(t1, t2.as_uri())
    m = manifest(t1, 3)
    doc = invoke_json("verify", "3", "--tier", "2", "--tier2", t2.as_uri())
    assert doc["ok"] is True and doc["files"] == len(m.files)
    assert doc["bytes"] == m.total_bytes
    ok = invoke("verify", "3", "--tier", "2", "--tier2", t2.as_uri())
    assert ok.exit_code == 0 and "ok" in ok.stdout
    assert_full_bar(ok.stderr, "verify")  # every byte checked, told on stderr
    name = shard(t1, 3).name
    flip_byte(t2 / Tier2Catalog(LocalStorage(t2)).resolve(3).key(name))  # its content object
    result = invoke("verify", "3", "--tier", "2", "--tier2", t2.as_uri())
    assert result.exit_code == 1
    assert name in result.stderr
    result = invoke("verify", "2", "--tier", "2", "--tier2", t2.as_uri())
    assert result.exit_code == 1 and "no complete step-00000002" in result.stderr


@pytest.mark.slow
def test_tier2_on_s3_ok_then_overwritten_object(template: Path, tmp_path: Path,
                                                s3_env: S3Env) -> None:
    t1 = clone(template, tmp_path / "t1")
    [r] = upload(t1, s3_env.url)
    assert (r.step, r.status) == (3, "verified")
    assert invoke_json("verify", "3", "--tier", "2", "--tier2", s3_env.url)["ok"] is True
    rows = invoke_json("ls", "--tier1", str(t1), "--tier2", s3_env.url)["checkpoints"]
    assert [(x["step"], x["state"]) for x in rows if x["tier"] == 2] == [(3, "verified")]

    # Replace one shard behind the store's back with one flipped byte (same size).
    bad = shard(t1, 3)
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF
    with open_storage(s3_env.url) as st:  # the step's content object (its map says which)
        key = f"{s3_env.prefix}/{Tier2Catalog(st).resolve(3).key(bad.name)}"
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(data))
    result = invoke("verify", "3", "--tier", "2", "--tier2", s3_env.url)
    assert result.exit_code == 1
    assert bad.name in result.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (("verify", "1", "--tier", "3"), "--tier must be 1 or 2"),
    (("verify", "1"), "--tier 1 needs --tier1"),
    (("verify", "1", "--tier", "2"), "--tier 2 needs --tier2"),
    (("verify", "--tier1", ".", "--", "-1"), "STEP must be >= 0"),
])
def test_bad_input_exits_2(args: tuple[str, ...], needle: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert needle in _flat(result.stderr)
    assert result.stdout == ""


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("verify") == {"step", "--tier", "--tier1", "--tier2", "--parallel", "--repair",
                               "--all", "--json"}
