"""``tierckpt doctor``: the probe of each real server as a table and as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from faultproxy import NO_MULTIPART, NO_MULTIPART_LISTING
from s3server import S3Env

import tierckpt.cli.doctor  # noqa: F401  (registers the command)
from tests.cli._helpers import flags, invoke, invoke_json


@pytest.mark.slow
def test_doctor_reports_each_server_and_the_modes(any_s3_env: S3Env) -> None:
    doc = invoke_json("doctor", "--tier2", any_s3_env.url)
    want = {"seaweedfs": "crc32c", "moto": "md5"}[any_s3_env.server.kind]
    assert doc["integrity"] == want and doc["marker"] == "create-only"
    assert doc["upload"] == "multipart"
    by = {f["field"]: f["supported"] for f in doc["features"]}
    assert by["basic_ops"] and by["multipart"] and by["if_none_match"]
    assert by["multipart_list"] and by["multipart_abort"]
    assert by["crc32c_put_verified"] is (want == "crc32c")
    table = invoke("doctor", "--tier2", any_s3_env.url)
    text = " ".join(table.stdout.split())
    assert table.exit_code == 0 and f"integrity: {want}" in text and "If-None-Match" in text
    assert any_s3_env.keys() == []  # the probe's scratch objects are gone


@pytest.mark.slow
@pytest.mark.parametrize("lacks", [NO_MULTIPART_LISTING, NO_MULTIPART],
                         ids=["no-multipart-listing", "no-multipart"])
def test_doctor_on_a_minimal_server_shows_single_puts(
        lacks: tuple[dict[str, Any], ...], s3_env: S3Env, fault_proxy: Any) -> None:
    """501 NotImplemented to multipart listing/abort (or to all of multipart): usable (exit
    0), the features say no, the upload mode is single-put and says why."""
    fault_proxy.not_implemented(lacks)
    doc = invoke_json("doctor", "--tier2", s3_env.url)
    assert (doc["integrity"], doc["marker"], doc["upload"]) == (
        "crc32c", "create-only", "single-put")
    by = {f["field"]: f["supported"] for f in doc["features"]}
    assert by["multipart_list"] is False
    assert by["multipart"] is (lacks is NO_MULTIPART_LISTING)
    assert any("one PUT" in w for w in doc["weaker"])
    assert "list multipart uploads: not supported, NotImplemented (HTTP 501)" in \
        doc["capabilities"]["notes"]
    table = invoke("doctor", "--tier2", s3_env.url)
    text = " ".join(table.stdout.split())
    assert table.exit_code == 0, table.output
    assert "upload: single-put" in text and "list multipart uploads" in text
    assert "every object goes in one PUT" in text


def test_doctor_on_a_missing_bucket_exits_2(any_s3_env: S3Env) -> None:
    r = invoke("doctor", "--tier2", "s3://no-such-bucket-doctor/p")
    assert r.exit_code == 2 and "bucket does not exist" in " ".join(r.stderr.split())


def test_doctor_on_a_directory(tmp_path: Path) -> None:
    assert invoke_json("doctor", "--tier2", tmp_path.as_uri())["integrity"] == "crc32c"


def test_flags_are_frozen() -> None:
    assert flags("doctor") == {"--tier2", "--json", "--cluster", "--tier1", "--script"}
