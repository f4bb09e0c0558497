"""``tierckpt ls`` over real CheckpointManager checkpoints and a file:// tier 2."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from faultproxy import NO_MULTIPART_LISTING
from s3server import S3Env

import tierckpt
import tierckpt.cli.ls
from tierckpt.format import layout
from tierckpt.tier0.root import BASE_ENV, JOB_FILE, default_root
from tierckpt.tier2.storage import LocalStorage

from ._checkpoints import clone, manifest, train_state, upload
from ._helpers import flags, invoke, invoke_json


def _rows(doc: dict, tier: int) -> dict[str, dict]:
    return {r["name"]: r for r in doc["checkpoints"] if r["tier"] == tier}


def test_every_state_on_both_tiers(template: Path, tmp_path: Path) -> None:
    t1 = clone(template, tmp_path / "t1")
    t2 = tmp_path / "t2"
    t2.mkdir()  # a file:// tier 2 must exist: opening one never creates it
    [r] = upload(t1, t2.as_uri(), every=2)  # the policy uploads step 2 only
    assert (r.step, r.status) == (2, "verified")
    (t1 / layout.PINS).mkdir(exist_ok=True)
    (t1 / layout.PINS / layout.pin_filename(1, "keep-me")).touch()
    (t1 / layout.tmp_dirname(4, "abc")).mkdir()  # a save in progress
    (t1 / layout.tmp_dirname(4, "abc") / "__0_0.distcp").write_bytes(b"x" * 10)
    LocalStorage(t2).put_bytes("step-00000005/__0_0.distcp", b"y" * 7)  # upload in progress

    t0 = time.time()
    doc = invoke_json("ls", "--tier1", str(t1), "--tier2", t2.as_uri())
    assert doc["tier1"] == str(t1) and doc["tier2"] == t2.as_uri()
    assert doc["tier2_modes"] is None  # no job probed a tier 2 for this root
    one, two = _rows(doc, 1), _rows(doc, 2)
    assert {n: r["state"] for n, r in one.items()} == {
        "step-00000004.tmp-abc": "partial", "step-00000003": "complete",
        "step-00000002": "verified", "step-00000001": "complete"}
    assert {n: r["state"] for n, r in two.items()} == {
        "step-00000005": "partial", "step-00000002": "verified"}
    assert one["step-00000001"]["pinned_by"] == ["keep-me"]
    assert one["step-00000002"]["upload_status"] == "verified"
    assert one["step-00000004.tmp-abc"]["bytes"] == 10 and two["step-00000005"]["bytes"] == 7
    # tier 2 holds the same files (shards, .metadata, manifest, COMPLETE) as tier 1
    assert two["step-00000002"]["bytes"] == one["step-00000002"]["bytes"]
    assert one["step-00000002"]["bytes"] > manifest(t1, 2).total_bytes
    # ages come from the manifest: saved before this test looked
    created = manifest(t1, 3).created_unix
    assert 0 <= one["step-00000003"]["age_s"] <= time.time() - created + 1
    assert one["step-00000003"]["age_s"] >= t0 - created - 1
    assert two["step-00000005"]["age_s"] is None
    # newest first, tier 1 before tier 2
    assert [(r["step"], r["tier"]) for r in doc["checkpoints"]] == [
        (5, 2), (4, 1), (3, 1), (2, 1), (2, 2), (1, 1)]


def test_failed_upload_and_damaged_marker(template: Path, tmp_path: Path) -> None:
    t1 = clone(template, tmp_path / "t1")
    shard = max((f for f in manifest(t1, 3).files), key=lambda f: f.size).name
    with open(t1 / "step-00000003" / shard, "r+b") as f:
        f.truncate(10)  # the uploader refuses a damaged checkpoint and records why
    (tmp_path / "t2").mkdir()  # a file:// tier 2 must exist
    [r] = upload(t1, (tmp_path / "t2").as_uri())
    assert r.status == "failed"
    (t1 / "step-00000001" / layout.MANIFEST).write_bytes(b"{}")  # its parts rebuild it
    marker = t1 / "step-00000002" / layout.COMPLETE
    marker.write_bytes(marker.read_bytes().replace(b'"step": 2', b'"step": 7'))
    one = _rows(invoke_json("ls", "--tier1", str(t1)), 1)
    assert one["step-00000003"]["state"] == "upload_failed"  # not "uploading"
    assert one["step-00000003"]["upload_status"] == "failed"
    assert "has 10 bytes" in one["step-00000003"]["detail"]
    assert one["step-00000001"]["state"] != "invalid"
    assert one["step-00000002"]["state"] == "invalid"
    assert "digest" in one["step-00000002"]["detail"]


def test_human_table(template: Path, tmp_path: Path) -> None:
    t1 = clone(template, tmp_path / "t1")
    (tmp_path / "t2").mkdir()  # a file:// tier 2 must exist
    upload(t1, (tmp_path / "t2").as_uri())
    result = invoke("ls", "--tier1", str(t1), "--tier2", (tmp_path / "t2").as_uri())
    assert result.exit_code == 0, result.output
    for fragment in ("step", "state", "verified", "complete", "age"):
        assert fragment in result.stdout


def test_the_tier2_modes_of_a_minimal_server(template: Path, tmp_path: Path, s3_env: S3Env,
                                             fault_proxy: Any) -> None:
    """The uploader probed an S3 server that answers 501 to multipart listing and abort:
    it uploaded in single PUTs, and ls shows that mode (recorded on tier 1) and why."""
    fault_proxy.not_implemented(NO_MULTIPART_LISTING)
    t1 = clone(template, tmp_path / "t1")
    [r] = upload(t1, s3_env.url)  # drain: the newest step
    assert (r.step, r.status) == (3, "verified")
    doc = invoke_json("ls", "--tier1", str(t1), "--tier2", s3_env.url)
    modes = doc["tier2_modes"]
    assert modes["url"] == s3_env.url and modes["upload"] == "single-put"
    assert (modes["integrity"], modes["marker"]) == ("crc32c", "create-only")
    assert [r["step"] for r in doc["checkpoints"] if r["tier"] == 2] == [3]
    result = invoke("ls", "--tier1", str(t1))
    text = " ".join(result.stdout.split())
    assert result.exit_code == 0, result.output
    assert f"tier 2 {s3_env.url}" in text and "upload single-put" in text
    assert "not supported: listing multipart uploads, aborting multipart uploads" in text


def test_a_tier2_that_cannot_be_listed_does_not_hide_tier1(
        template: Path, tmp_path: Path, s3_env: S3Env, fault_proxy: Any) -> None:
    t1 = clone(template, tmp_path / "t1")
    fault_proxy.add_rule("status", status=403, code="AccessDenied", times=None)
    result = invoke("ls", "--tier1", str(t1), "--tier2", s3_env.url)
    assert result.exit_code == 1, result.output
    assert "complete" in result.stdout and "step" in result.stdout  # tier 1's rows
    err = " ".join(result.stderr.split())
    assert f"tier 2 {s3_env.url} could not be listed" in err and "tier 1 only" in err
    doc = json.loads(invoke("ls", "--tier1", str(t1), "--tier2", s3_env.url,
                            "--json").stdout)
    assert doc["checkpoints"] and {r["tier"] for r in doc["checkpoints"]} == {1}
    assert "403" in doc["tier2_error"] or "AccessDenied" in doc["tier2_error"]


def test_empty_and_missing_roots(tmp_path: Path) -> None:
    result = invoke("ls", "--tier1", str(tmp_path))
    assert result.exit_code == 0 and "no checkpoints" in result.stdout
    assert invoke_json("ls", "--tier1", str(tmp_path))["checkpoints"] == []
    result = invoke("ls", "--tier1", str(tmp_path / "nope"))
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())  # rich wraps long lines
    assert "nope" in err and "not a directory" in err
    result = invoke("ls", "--tier1", str(tmp_path), "--tier2", "ftp://x/y")
    assert result.exit_code == 2 and "ftp://x/y" in result.stderr


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("ls") == {"--tier1", "--tier2", "--tier0", "--json"}


def test_an_endpoint_without_a_scheme_exits_2_naming_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "localhost:9000")
    result = invoke("ls", "--tier1", str(tmp_path), "--tier2", "s3://b/p")
    err = " ".join(result.stderr.split())
    assert result.exit_code == 2, result.output
    assert "AWS_ENDPOINT_URL='localhost:9000'" in err and "http://host:port" in err


def test_bad_or_missing_tier2_exits_2(tmp_path: Path) -> None:
    for url, needle in (("s3://b:9000/p", "host:port, not a bucket name"),
                        ("file://relative/p", "file:///absolute/path"),
                        ((tmp_path / "unmounted").as_uri(), "does not exist")):
        result = invoke("ls", "--tier1", str(tmp_path), "--tier2", url)
        assert result.exit_code == 2 and needle in " ".join(result.stderr.split()), result.output
    assert not (tmp_path / "unmounted").exists()


def test_tier0_rows_where_this_node_holds_the_jobs_ram(
        template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Tier0() job's RAM (found from --tier1) and a Tier0(path) job's (--tier0) are
    listed as tier 0, newest first: RAM held step 3 while tier 1's newest was 2."""
    monkeypatch.setenv(BASE_ENV, str(tmp_path / "shm"))
    t1 = clone(template, tmp_path / "t1")
    ram = default_root(t1.absolute())
    ram.mkdir(parents=True)
    (ram / JOB_FILE).write_text(json.dumps({"tier1": str(t1.absolute())}))
    shutil.move(t1 / layout.step_dirname(3), ram / layout.step_dirname(3))
    doc = invoke_json("ls", "--tier1", str(t1))
    assert doc["tier0"] == str(ram)
    assert [(r["step"], r["tier"], r["state"]) for r in doc["checkpoints"]] == [
        (3, 0, "complete"), (2, 1, "complete"), (1, 1, "complete")]
    result = invoke("ls", "--tier1", str(t1))
    assert result.exit_code == 0 and "(tier 0)" in result.stdout  # the title names it
    assert any([c.strip() for c in line.split("│")[1:3]] == ["3", "0"]  # step 3, tier 0
               for line in result.stdout.splitlines())
    named = tmp_path / "named"
    shutil.move(ram, named)
    assert invoke_json("ls", "--tier1", str(t1))["tier0"] is None  # not visible here
    first = invoke_json("ls", "--tier1", str(t1), "--tier0", str(named))["checkpoints"][0]
    assert (first["step"], first["tier"]) == (3, 0)
    other = tmp_path / "other"
    shutil.copytree(named, other)
    (other / JOB_FILE).write_text(json.dumps({"tier1": "/another/job"}))
    result = invoke("ls", "--tier1", str(t1), "--tier0", str(other))
    assert result.exit_code == 2 and "belongs to another job" in " ".join(result.stderr.split())


def test_ls_says_what_the_upload_cadence_copies_next(tmp_path: Path) -> None:
    root, bucket = tmp_path / "t1", tmp_path / "b"
    bucket.mkdir()
    st = train_state(0)
    with tierckpt.CheckpointManager(tier1=root, keep_last=10, tier2=tierckpt.Tier2(
            bucket.as_uri(), upload_every=3, start_uploader=False)) as ck:
        for step in (9, 19, 29, 39):  # commits 1-4: the 3rd is marked
            ck.save(step, st).wait(60)
    # the clean close asked for the newest (39) by name as well
    assert invoke_json("ls", "--tier1", str(root))["upload_cadence"] == {
        "upload_every": 3, "counted": 1, "commits_to_next": 2, "waiting": [29, 39]}
    out = " ".join(invoke("ls", "--tier1", str(root)).stdout.split())
    assert "tier 2 copies one commit in 3 (1 counted since the last)" in out
    assert "next: the commit 2 from now; waiting: 29, 39" in out
