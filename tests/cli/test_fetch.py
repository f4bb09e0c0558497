"""``tierckpt fetch``: tier 2 → tier 1, verified and committed; a fetched checkpoint restores
exactly; the root lock keeps it away from a live job."""

from __future__ import annotations

from pathlib import Path

import tierckpt
import tierckpt.cli.fetch  # registers the command
from tierckpt.format import layout
from tierckpt.restore.verify import verify_checkpoint

from ._checkpoints import clone, flip_byte, manifest, shard, train_state, upload
from ._helpers import assert_full_bar, flags, invoke, invoke_json


def test_fetch_into_an_empty_root_then_restore(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    upload(t1, t2.as_uri())
    fresh = tmp_path / "replaced-node"  # a new machine: nothing on tier 1
    doc = invoke_json("fetch", "3", "--tier1", str(fresh), "--tier2", t2.as_uri())
    m = manifest(t1, 3)
    assert doc["bytes_downloaded"] == m.total_bytes and doc["bytes_reused"] == 0
    assert doc["path"] == str(fresh / "step-00000003")
    assert verify_checkpoint(fresh / "step-00000003", step=3, full=True) == m
    st = train_state(seed=7)
    with tierckpt.CheckpointManager(tier1=fresh) as ck:
        info = ck.restore(st)
    assert info is not None and (info.step, info.source) == (3, "tier1")
    assert st.extra == {"tokens": 3}


def test_refetch_reuses_intact_files_and_replaces_a_corrupt_one(template: Path,
                                                               tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    upload(t1, t2.as_uri())
    m = manifest(t1, 3)
    doc = invoke_json("fetch", "3", "--tier1", str(t1), "--tier2", t2.as_uri())
    assert doc["bytes_downloaded"] == 0 and doc["bytes_reused"] == m.total_bytes
    bad = shard(t1, 3)
    flip_byte(bad)
    result = invoke("fetch", "3", "--tier1", str(t1), "--tier2", t2.as_uri())  # --full default
    assert result.exit_code == 0, result.output
    assert "fetched" in result.stdout
    assert_full_bar(result.stderr, "fetch")  # the bar on stderr, at its end: all in place
    assert verify_checkpoint(t1 / "step-00000003", step=3, full=True) == m
    # the damaged directory was moved aside, not deleted
    assert any(p.name.startswith("step-00000003.replaced-by-fetch")
               for p in (t1 / layout.QUARANTINE).iterdir())


def test_missing_step_and_live_job(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    upload(t1, t2.as_uri())
    result = invoke("fetch", "2", "--tier1", str(tmp_path / "x"), "--tier2", t2.as_uri())
    assert result.exit_code == 1
    assert "no complete step 2" in result.stderr and "complete there: 3" in result.stderr
    assert not (tmp_path / "x").exists()
    with tierckpt.CheckpointManager(tier1=tmp_path / "busy"):
        result = invoke("fetch", "3", "--tier1", str(tmp_path / "busy"), "--tier2",
                        t2.as_uri())
    assert result.exit_code == 1 and "another job" in result.stderr
    assert not (tmp_path / "busy" / "step-00000003").exists()


def test_bad_input_exits_2(tmp_path: Path) -> None:
    result = invoke("fetch", "1", "--tier1", str(tmp_path), "--tier2", "nope://x")
    assert result.exit_code == 2 and "nope://x" in result.stderr
    result = invoke("fetch", "1", "--tier1", str(tmp_path), "--tier2",
                    (tmp_path / "t2").as_uri(), "--parallel", "0")
    assert result.exit_code == 2 and "--parallel" in result.stderr
    assert invoke("fetch", "1", "--tier1", str(tmp_path)).exit_code == 2  # --tier2 is required


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("fetch") == {"step", "--tier1", "--tier2", "--full", "--sizes", "--parallel",
                              "--json"}


def test_json_prints_no_progress_bar(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()
    upload(t1, t2.as_uri())
    result = invoke("fetch", "3", "--tier1", str(tmp_path / "n"), "--tier2", t2.as_uri(),
                    "--json")
    assert result.exit_code == 0 and result.stderr == "", result.stderr
