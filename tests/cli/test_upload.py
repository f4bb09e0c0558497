"""``tierckpt upload``: foreground uploads of real checkpoints to a file:// tier 2, failures,
the per-root uploader lock, and ``--watch`` as a real process stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import tierckpt.cli.upload  # noqa: F401  (registers the command)
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage
from tierckpt.tier2.uploader import Uploader, UploaderConfig

from ._checkpoints import clone, manifest, save_steps, shard
from ._helpers import flags, invoke, invoke_json


def test_uploads_newest_verified_then_nothing_left(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    doc = invoke_json("upload", "--tier1", str(t1), "--tier2", t2.as_uri())
    # the policy copies the newest due step; older ones are abandoned, never uploaded late
    assert [(r["step"], r["status"]) for r in doc["results"]] == [(3, "verified")]
    m = manifest(t1, 3)
    assert doc["results"][0]["bytes"] == m.total_bytes
    assert Tier2Catalog(LocalStorage(t2)).read_committed(3)[0] == m
    assert Tier1Catalog(t1).uploads.upload_record(3)["status"] == "verified"  # type: ignore[index]
    again = invoke("upload", "--tier1", str(t1), "--tier2", t2.as_uri())
    assert again.exit_code == 0 and "nothing to upload" in again.stdout


def test_every_and_tier2_retention(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    # every 2nd commit, counted (commits 1, 2, 3: the 2nd is due), whatever the step numbers
    assert [r["step"] for r in invoke_json(
        "upload", "--tier1", str(t1), "--tier2", t2.as_uri(), "--every", "2")["results"]] == [2]
    save_steps(t1, [5, 7, 9])  # commits 4, 5, 6: the 4th and 6th are due
    result = invoke("upload", "--tier1", str(t1), "--tier2", t2.as_uri(), "--every", "2",
                    "--keep-last", "1")
    assert result.exit_code == 0, result.output
    assert "verified" in result.stdout and "step 9" in result.stdout
    bar = " ".join(result.stderr.split())  # the progress bar, on stderr, ends full
    total = manifest(t1, 9).total_bytes / 1000
    assert "step 9" in bar and f"{total:.1f}/{total:.1f} kB" in bar
    assert Tier2Catalog(LocalStorage(t2)).complete_steps() == [9]  # keep-last 1 on tier 2


def test_damaged_checkpoint_fails_with_exit_1(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    bad = shard(t1, 3)
    with open(bad, "r+b") as f:
        f.truncate(5)
    result = invoke("upload", "--tier1", str(t1), "--tier2", t2.as_uri())
    assert result.exit_code == 1
    assert "failed" in result.stdout and bad.name in " ".join(result.stdout.split())
    assert Tier2Catalog(LocalStorage(t2)).complete_steps() == []  # no marker over a damaged copy
    doc = invoke("upload", "--tier1", str(t1), "--tier2", t2.as_uri(), "--json")
    assert doc.exit_code == 1 and '"status": "failed"' in doc.stdout


def test_a_second_uploader_on_the_root_is_refused(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    with Uploader(UploaderConfig(tier1=t1, tier2=t2.as_uri())):
        result = invoke("upload", "--tier1", str(t1), "--tier2", t2.as_uri())
    assert result.exit_code == 1 and "another uploader" in result.stderr
    assert not t2.exists() or Tier2Catalog(LocalStorage(t2)).complete_steps() == []


def test_bad_input_exits_2(tmp_path: Path) -> None:
    for args, needle in ((("--every", "0"), "upload_every"), (("--keep-last", "0"), "keep_last"),
                         (("--poll", "0"), "poll_s")):
        result = invoke("upload", "--tier1", str(tmp_path), "--tier2",
                        (tmp_path / "t2").as_uri(), *args)
        assert result.exit_code == 2 and needle in result.stderr
    result = invoke("upload", "--tier1", str(tmp_path / "nope"), "--tier2",
                    (tmp_path / "t2").as_uri())
    assert result.exit_code == 2 and "not a directory" in " ".join(result.stderr.split())
    assert not (tmp_path / "nope").exists()
    result = invoke("upload", "--tier1", str(tmp_path), "--tier2", "s3://user:pw@host/b")
    assert result.exit_code == 2 and "AWS_ENDPOINT_URL" in " ".join(result.stderr.split())


def _wait_for(cond: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert proc.poll() is None, f"the watcher exited early waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_watch_uploads_new_checkpoints_until_sigterm(template: Path, tmp_path: Path) -> None:
    t1, t2 = clone(template, tmp_path / "t1"), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    code = "import sys; from tierckpt.cli import main; sys.argv[0] = 'tierckpt'; main()"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, "upload", "--tier1", str(t1),
                             "--tier2", t2.as_uri(), "--watch", "--poll", "0.1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        storage = LocalStorage(t2)
        _wait_for(lambda: (Tier1Catalog(t1).uploads.upload_record(3) or {}).get("status")
                  == "verified", "step 3", proc)
        save_steps(t1, [4])  # a job saves while the watcher runs (different locks)
        _wait_for(lambda: 4 in Tier2Catalog(storage).complete_steps(), "step 4", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert b"step 3" in out + err and b"step 4" in out + err
    assert Tier2Catalog(storage).read_committed(4)[0] == manifest(t1, 4)
    assert Tier1Catalog(t1).pins() == {}  # unpinned after each verified upload


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("upload") == {"--tier1", "--tier2", "--watch", "--every", "--keep-last",
                               "--keep-every", "--poll", "--json"}
