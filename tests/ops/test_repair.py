"""Repair of a tier-2 step from tier 1 (ops/repair.py, ``tierckpt verify --tier 2
--repair``): a damaged content object that later uploads inherit (the uploader skips an
object whose metadata matches) is sent again from a tier-1 copy that verifies, which mends
every step naming it; nothing is deleted, and a file without a good copy is reported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from s3server import S3Env

from tests._synthetic import make_checkpoint
from tests.cli._helpers import assert_full_bar
from tests.tier2.test_content import BASE, _restores_from_tier2_alone, _upload, derive
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.ops.check import check_tier2
from tierckpt.ops.repair import repair_tier2
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage, open_storage

FROZEN = "__0_0.distcp"
CLI = [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
       "sys.argv[0] = 'tierckpt'; main()"]


def _three_steps(t1: Path, remote: Tier2Catalog, *, flip_after: int) -> str:
    """Steps 1-3 sharing the frozen file; its object flipped once step ``flip_after`` is
    uploaded (bit rot at rest); returns the object's key."""
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"}, linked=frozenset({FROZEN}))
    derive(t1, 2, 3, changed={"__0_1.distcp"}, linked=frozenset({FROZEN}))
    key = ""
    for step in (1, 2, 3):
        _upload(t1, remote, step)
        key = remote.resolve(step).key(FROZEN)
        if step == flip_after:
            p = Path(remote.storage.url.removeprefix("file://")) / key
            data = bytearray(p.read_bytes())
            data[777] ^= 0x01
            p.write_bytes(bytes(data))
    return key


def test_a_damaged_shared_object_is_inherited_and_one_repair_mends_every_step(
        tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    st = LocalStorage(t2)
    remote = Tier2Catalog(st)
    _three_steps(t1, remote, flip_after=1)
    # the upload of steps 2 and 3 skipped the object (its metadata matched): all three broken
    assert [check_tier2(st, s).ok for s in (1, 2, 3)] == [False, False, False]
    keep = tmp_path / "expected"
    shutil.copytree(t1, keep)
    r = repair_tier2(st, 3, t1)
    assert r.ok and r.files == len(BASE)
    assert r.repaired == ((FROZEN, str(t1 / layout.step_dirname(3) / FROZEN)),)
    assert [check_tier2(st, s).ok for s in (1, 2, 3)] == [True, True, True]
    shutil.rmtree(t1)
    for step in (1, 2, 3):  # from tier 2 alone, byte for byte
        _restores_from_tier2_alone(remote, keep, tmp_path / f"fresh{step}", step)
    again = repair_tier2(st, 3, keep)  # a whole step: nothing to send
    assert again.ok and again.repaired == () and again.left == ()


def test_the_copy_of_another_step_serves_when_the_step_left_tier1(tmp_path: Path) -> None:
    """Step 1 was retired from tier 1; the frozen file lives on in step 3."""
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    st = LocalStorage(t2)
    remote = Tier2Catalog(st)
    key = _three_steps(t1, remote, flip_after=3)
    shutil.rmtree(t1 / layout.step_dirname(1))
    (t2 / key).unlink()  # and the object gone as well as damaged before: missing now
    r = repair_tier2(st, 1, t1)
    assert r.ok and r.repaired == ((FROZEN, str(t1 / layout.step_dirname(3) / FROZEN)),)
    assert check_tier2(st, 1).ok and check_tier2(st, 3).ok


def test_without_a_good_copy_the_file_is_reported_and_nothing_changes(
        tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    st = LocalStorage(t2)
    key = _three_steps(t1, Tier2Catalog(st), flip_after=3)
    damaged = (t2 / key).read_bytes()
    linked = t1 / layout.step_dirname(3) / FROZEN  # one inode in steps 1-3: it rotted too
    rotten = bytearray(linked.read_bytes())
    rotten[5] ^= 0x80
    linked.write_bytes(bytes(rotten))
    r = repair_tier2(st, 3, t1)
    assert not r.ok and r.repaired == ()
    ((name, why),) = r.left
    assert name == FROZEN and f"no copy of it on {t1} matches the manifest" in why
    for step in (1, 2, 3):  # a node that never held the file
        (t1 / layout.step_dirname(step) / FROZEN).unlink()
    ((name, why),) = repair_tier2(st, 3, t1).left
    assert "does not hold it: run this where the tier 1" in why
    assert (t2 / key).read_bytes() == damaged  # nothing deleted, nothing replaced
    with pytest.raises(ConfigError, match="--parallel must be >= 1, got 0"):
        repair_tier2(st, 3, t1, parallel=0)
    assert [p.name for p in (t2 / layout.step_dirname(3)).iterdir()]  # the step stands


def test_the_cli_repairs_and_says_what_it_sent(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    _three_steps(t1, Tier2Catalog(LocalStorage(t2)), flip_after=2)
    url = f"file://{t2}"
    broken = subprocess.run([*CLI, "verify", "2", "--tier", "2", "--tier2", url],
                            capture_output=True, text=True)
    assert broken.returncode == 1 and FROZEN in broken.stderr
    fixed = subprocess.run([*CLI, "verify", "2", "--tier", "2", "--tier2", url, "--repair",
                            "--tier1", str(t1), "--json"], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stderr
    doc = json.loads(fixed.stdout)
    assert doc["ok"] is True and doc["step"] == 2 and doc["left"] == []
    assert [r["file"] for r in doc["repaired"]] == [FROZEN]
    text = subprocess.run([*CLI, "verify", "3", "--tier", "2", "--tier2", url, "--repair",
                           "--tier1", str(t1)], capture_output=True, text=True)
    assert text.returncode == 0 and "0 repaired" in " ".join(text.stdout.split())
    assert_full_bar(text.stderr, "repair")  # every object checked; none with --json:
    assert fixed.stderr == ""
    bad = subprocess.run([*CLI, "verify", "2", "--tier", "2", "--tier2", url, "--repair"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "give --tier 2, --tier2 URL and --tier1 DIR" in " ".join(
        bad.stderr.split())


def test_a_missing_object_is_sent_again_to_the_s3_server(tmp_path: Path,
                                                         s3_env: S3Env) -> None:
    t1 = tmp_path / "t1"
    make_checkpoint(t1, 1, BASE)
    derive(t1, 1, 2, changed={"__0_1.distcp"}, linked=frozenset({FROZEN}))
    with open_storage(f"{s3_env.url}/repair-{tmp_path.name}") as st:
        remote = Tier2Catalog(st)
        _upload(t1, remote, 1)
        _upload(t1, remote, 2)
        st.delete(remote.resolve(2).key(FROZEN))
        assert not check_tier2(st, 1).ok and not check_tier2(st, 2).ok
        r = repair_tier2(st, 2, t1)
        assert r.ok and [f for f, _ in r.repaired] == [FROZEN]
        assert check_tier2(st, 1).ok and check_tier2(st, 2).ok
