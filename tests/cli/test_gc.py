"""``tierckpt gc``: dry run by default, retention on both tiers, never the newest, a pinned
or a not-yet-uploaded checkpoint, and never while a job holds the tier-1 root."""

from __future__ import annotations

from pathlib import Path

import tierckpt
import tierckpt.cli.gc  # registers the command
from tierckpt.format import layout
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage

from ._checkpoints import clone, save_steps, upload
from ._helpers import flags, invoke, invoke_json


def _five(template: Path, tmp_path: Path) -> Path:
    t1 = clone(template, tmp_path / "t1")
    save_steps(t1, [4, 5])
    return t1


def test_dry_run_then_yes(template: Path, tmp_path: Path) -> None:
    t1 = _five(template, tmp_path)
    (t1 / layout.PINS).mkdir(exist_ok=True)
    (t1 / layout.PINS / layout.pin_filename(1, "user")).touch()
    (t1 / layout.tmp_dirname(6, "crashed")).mkdir()
    doc = invoke_json("gc", "--tier1", str(t1), "--keep-last", "2")
    assert doc["applied"] is False
    assert doc["tier1"]["delete"] == [2, 3]
    assert doc["tier1"]["stale"] == ["step-00000006.tmp-crashed"]
    assert doc["tier1"]["keep"] == {"5": "newest", "4": "keep-last 2", "1": "pinned"}
    assert doc["tier2"] is None
    assert doc["tier1_root"] == str(t1) and doc["tier2_url"] is None
    assert Tier1Catalog(t1).complete_steps() == [5, 4, 3, 2, 1]  # a dry run deletes nothing
    result = invoke("gc", "--tier1", str(t1), "--keep-last", "2")
    words = " ".join(result.stdout.split())  # the console wraps at 80 columns: a long path
    assert result.exit_code == 0 and "would delete" in words and "dry run" in words

    result = invoke("gc", "--tier1", str(t1), "--keep-last", "2", "--yes")
    assert result.exit_code == 0, result.output
    assert "deleted" in result.stdout
    assert Tier1Catalog(t1).complete_steps() == [5, 4, 1]
    assert not (t1 / layout.tmp_dirname(6, "crashed")).exists()
    assert invoke_json("gc", "--tier1", str(t1), "--keep-last", "2")["tier1"]["delete"] == []


def test_keep_last_1_never_deletes_the_newest(template: Path, tmp_path: Path) -> None:
    t1 = clone(template, tmp_path / "t1")
    doc = invoke_json("gc", "--tier1", str(t1), "--keep-last", "1", "--yes")
    assert doc["tier1"]["delete"] == [1, 2]
    assert Tier1Catalog(t1).complete_steps() == [3]


def test_keeps_what_the_uploader_has_yet_to_copy(template: Path, tmp_path: Path) -> None:
    t1, t2 = _five(template, tmp_path), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    assert [r.step for r in upload(t1, t2.as_uri(), steps=[3])] == [3]
    # 3 is on tier 2; 4 and 5 are due and newer than it: the uploader still has to copy them
    doc = invoke_json("gc", "--tier1", str(t1), "--keep-last", "1", "--yes")
    assert doc["tier1"]["delete"] == [1, 2, 3]
    assert doc["tier1"]["keep"] == {"5": "newest", "4": "not yet on tier 2"}
    assert Tier1Catalog(t1).complete_steps() == [5, 4]
    # the hold follows the upload policy: with --upload-every 5 step 4 is never due
    doc = invoke_json("gc", "--tier1", str(t1), "--keep-last", "1", "--upload-every", "5")
    assert doc["tier1"]["delete"] == [4]


def test_tier2_retention(template: Path, tmp_path: Path) -> None:
    t1, t2 = _five(template, tmp_path), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    upload(t1, t2.as_uri(), steps=[1, 2, 3, 4, 5])
    args = ("gc", "--tier1", str(t1), "--tier2", t2.as_uri(), "--keep-last", "5",
            "--tier2-keep-last", "2", "--tier2-keep-every", "2")
    doc = invoke_json(*args)
    assert doc["tier2"] == {"delete": [1, 3], "keep": [5, 4, 2]}
    assert Tier2Catalog(LocalStorage(t2)).complete_steps() == [1, 2, 3, 4, 5]
    assert invoke_json(*args, "--yes")["applied"] is True
    assert Tier2Catalog(LocalStorage(t2)).complete_steps() == [2, 4, 5]
    assert LocalStorage(t2).list("step-00000001/") == []  # every object, not just the marker
    assert Tier1Catalog(t1).complete_steps() == [5, 4, 3, 2, 1]  # --keep-last 5 kept tier 1 whole


def test_refuses_while_a_job_holds_the_root(template: Path, tmp_path: Path) -> None:
    t1 = clone(template, tmp_path / "t1")
    with tierckpt.CheckpointManager(tier1=t1, keep_last=10):
        result = invoke("gc", "--tier1", str(t1), "--keep-last", "1", "--yes")
    assert result.exit_code == 1
    assert "another job" in result.stderr
    assert Tier1Catalog(t1).complete_steps() == [3, 2, 1]


def test_bad_input_exits_2(tmp_path: Path) -> None:
    for args, needle in ((("--keep-last", "0"), "keep-last"),
                         (("--upload-every", "0"), "upload-every"),
                         (("--tier2-keep-every", "-1"), "tier2-keep-every")):
        result = invoke("gc", "--tier1", str(tmp_path), *args)
        assert result.exit_code == 2 and needle in result.stderr, result.stderr
    result = invoke("gc", "--tier1", str(tmp_path / "missing"))
    assert result.exit_code == 2 and "not a directory" in " ".join(result.stderr.split())


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("gc") == {"--tier1", "--tier2", "--keep-last", "--upload-every",
                           "--tier2-keep-last", "--tier2-keep-every", "--yes", "--json"}


def test_gc_applies_the_policy_the_job_recorded(template: Path, tmp_path: Path) -> None:
    """Without retention flags, gc keeps what the job keeps: here every 2nd step on tier 2
    forever (the milestones a gc with default flags would delete) and 5 steps on tier 1."""
    t1, t2 = _five(template, tmp_path), tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    upload(t1, t2.as_uri(), steps=[1, 2, 3, 4, 5])
    assert Tier1Catalog(t1).recorded_policy() is None  # the template's job had no tier 2
    with tierckpt.CheckpointManager(tier1=t1, keep_last=5, tier2=tierckpt.Tier2(
            t2.as_uri(), keep_last=1, keep_every=2, start_uploader=False)):
        pass
    doc = invoke_json("gc", "--tier1", str(t1), "--tier2", t2.as_uri(), "--yes")
    assert doc["tier2"] == {"delete": [1, 3], "keep": [5, 4, 2]}
    assert doc["tier1"]["delete"] == []
    assert doc["policy"] == {
        "keep_last": 5, "upload_every": 1, "tier2_keep_last": 1, "tier2_keep_every": 2,
        "from": dict.fromkeys(("keep_last", "upload_every", "tier2_keep_last",
                               "tier2_keep_every"), "recorded by the job"),
        "recorded": str(t1 / layout.UPLOAD_STATE / layout.JOB_POLICY),
        "recorded_tier2": t2.as_uri()}
    assert Tier2Catalog(LocalStorage(t2)).complete_steps() == [2, 4, 5]
    assert Tier1Catalog(t1).complete_steps() == [5, 4, 3, 2, 1]
    # a flag still wins, knob by knob, and the plan says so
    result = invoke("gc", "--tier1", str(t1), "--tier2", t2.as_uri(),
                    "--tier2-keep-every", "0")
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "tier2-keep-every 0 (flags)" in out and "tier2-keep-last 1 (recorded by the job)" in out
    assert "keep-last 5 (recorded by the job)" in out


def test_without_a_record_the_defaults_apply_and_say_so(template: Path, tmp_path: Path) -> None:
    t1 = _five(template, tmp_path)
    doc = invoke_json("gc", "--tier1", str(t1), "--keep-last", "2")
    assert doc["policy"]["from"] == {"keep_last": "flags", "upload_every": "defaults",
                                     "tier2_keep_last": "defaults",
                                     "tier2_keep_every": "defaults"}
    assert doc["policy"]["recorded"] is None and doc["policy"]["tier2_keep_last"] == 3


def test_a_damaged_record_stops_gc_unless_every_knob_is_given(template: Path,
                                                              tmp_path: Path) -> None:
    t1 = _five(template, tmp_path)
    cat = Tier1Catalog(t1)
    cat.policy_path().parent.mkdir(exist_ok=True)
    cat.policy_path().write_text("{oops")
    result = invoke("gc", "--tier1", str(t1), "--keep-last", "2", "--yes")
    assert result.exit_code == 1 and layout.JOB_POLICY in result.stderr
    assert cat.complete_steps() == [5, 4, 3, 2, 1]
    # upload-state/ exists, so what the uploader has yet to copy is held: with every 5th
    # step due, only 5 (the newest anyway)
    every = ("--keep-last", "2", "--upload-every", "5", "--tier2-keep-last", "3",
             "--tier2-keep-every", "0")
    assert invoke_json("gc", "--tier1", str(t1), *every)["tier1"]["delete"] == [1, 2, 3]


def test_a_missing_file_tier2_exits_2_and_is_not_created(template: Path,
                                                        tmp_path: Path) -> None:
    t1 = _five(template, tmp_path)
    result = invoke("gc", "--tier1", str(t1), "--tier2", (tmp_path / "unmounted").as_uri(),
                    "--yes")
    assert result.exit_code == 2 and "does not exist" in " ".join(result.stderr.split())
    assert not (tmp_path / "unmounted").exists()
    assert Tier1Catalog(t1).complete_steps() == [5, 4, 3, 2, 1]
