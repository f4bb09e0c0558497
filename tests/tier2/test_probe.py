"""What each server supports, and the modes chosen from it: pure cases, then the real probe
of SeaweedFS and moto's S3 server, its cleanup and its cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from s3server import S3Env

from tierckpt.errors import ConfigError
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2 import probe
from tierckpt.tier2.capabilities import Capabilities, IntegrityMode, MarkerMode, choose

FULL = Capabilities(server="s", basic_ops=True, ranged_get=True, multipart=True,
                    crc32c_put_verified=True, crc32c_head=True, crc32c_multipart=True,
                    md5_verified=True, etag_is_md5=True, if_none_match=True)


def test_the_strongest_mode_the_server_honours() -> None:
    assert choose(FULL).integrity is IntegrityMode.CRC32C and not choose(FULL).weaker
    no_crc = dataclasses.replace(FULL, crc32c_multipart=False)  # e.g. InvalidPart on MinIO
    assert choose(no_crc).integrity is IntegrityMode.MD5 and choose(no_crc).weaker
    etag_only = dataclasses.replace(no_crc, md5_verified=False)  # moto
    assert choose(etag_only).integrity is IntegrityMode.MD5
    nothing = dataclasses.replace(etag_only, etag_is_md5=False, crc32c_put_verified=False)
    assert choose(nothing).integrity is None
    assert choose(dataclasses.replace(FULL, multipart=False)).integrity is None
    ignores_inm = choose(dataclasses.replace(FULL, if_none_match=False))
    assert ignores_inm.marker is MarkerMode.READBACK and "If-None-Match" in ignores_inm.weaker[0]


def test_no_integrity_mode_is_a_config_error() -> None:
    r = probe.ProbeResult(url="s3://b/p", capabilities=dataclasses.replace(
        FULL, crc32c_put_verified=False, md5_verified=False, etag_is_md5=False,
        notes=("PUT with a wrong Content-MD5: accepted",)), modes=choose(dataclasses.replace(
            FULL, crc32c_put_verified=False, md5_verified=False, etag_is_md5=False)),
        probed_unix=0.0)
    with pytest.raises(ConfigError, match=r"cannot be verified end to end.*Content-MD5"):
        probe.require_usable(r)
    readback = dataclasses.replace(r, modes=choose(dataclasses.replace(FULL,
                                                                       if_none_match=False)))
    probe.require_usable(readback)
    with pytest.raises(ConfigError, match="If-None-Match"):
        probe.require_usable(readback, conditional_writes=True)


EXPECTED = {  # measured here; docs/tier2-servers.md
    "seaweedfs": {"integrity": IntegrityMode.CRC32C, "marker": MarkerMode.CREATE_ONLY,
                  "crc32c_put_verified": True, "crc32c_multipart": True},
    "moto": {"integrity": IntegrityMode.MD5, "marker": MarkerMode.CREATE_ONLY,
             "crc32c_put_verified": False, "md5_verified": False, "etag_is_md5": True},
}


def test_probe_each_server(any_s3_env: S3Env) -> None:
    r = probe.probe_url(any_s3_env.url)
    want = EXPECTED[any_s3_env.server.kind]
    assert r.modes.integrity is want["integrity"] and r.modes.marker is want["marker"]
    for name, value in want.items():
        if name not in ("integrity", "marker"):
            assert getattr(r.capabilities, name) is value, (name, r.capabilities)
    assert r.capabilities.basic_ops and r.capabilities.ranged_get and r.capabilities.multipart
    assert r.s3_options() == {"integrity": want["integrity"].value,
                              "marker": want["marker"].value}
    assert any_s3_env.keys() == [] and any_s3_env.pending_uploads() == []  # scratch removed


def test_the_probe_is_cached_per_server(tmp_path: Path, any_s3_env: S3Env,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    local = Tier1Catalog(tmp_path)
    first = probe.probe_cached(local, any_s3_env.url)
    assert probe.cached(local, any_s3_env.url) == first  # the uploader reads this
    assert probe.cached(local, any_s3_env.url + "-other") is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # another server
    assert probe.cached(local, any_s3_env.url) is None


def test_local_tier2_needs_no_probe(tmp_path: Path) -> None:
    r = probe.probe_url(tmp_path.as_uri())
    assert r.modes.integrity is IntegrityMode.CRC32C and r.s3_options() == {}
