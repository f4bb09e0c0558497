"""What each server supports, and the modes chosen from it: pure cases, then the real probe
of SeaweedFS and moto's S3 server, its cleanup and its cache."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
from faultproxy import LIST_UPLOADS, NO_MULTIPART, NO_MULTIPART_LISTING
from s3server import S3Env

from tierckpt.errors import ConfigError, StorageError
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2 import probe
from tierckpt.tier2.capabilities import (
    Capabilities,
    IntegrityMode,
    MarkerMode,
    UploadMode,
    choose,
)

FULL = Capabilities(server="s", basic_ops=True, ranged_get=True, multipart=True,
                    multipart_list=True, multipart_abort=True,
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
    ignores_inm = choose(dataclasses.replace(FULL, if_none_match=False))
    assert ignores_inm.marker is MarkerMode.READBACK and "If-None-Match" in ignores_inm.weaker[0]


def test_without_multipart_listing_or_abort_every_object_is_one_put() -> None:
    assert choose(FULL).upload is UploadMode.MULTIPART
    old = dataclasses.replace(FULL, multipart_list=None, multipart_abort=None)
    assert choose(old).upload is UploadMode.MULTIPART  # a probe recorded before these fields
    for lacks in ({"multipart_list": False}, {"multipart_abort": False},
                  {"multipart": False, "multipart_abort": None, "crc32c_multipart": False}):
        m = choose(dataclasses.replace(FULL, **lacks))
        assert m.upload is UploadMode.SINGLE_PUT, lacks
        assert m.integrity is IntegrityMode.CRC32C  # no multipart CRC32C needed
        assert len(m.weaker) == 1 and "one PUT (at most 5 GiB" in m.weaker[0], m.weaker
    # only single PUTs: their ETags (MD5s) are enough for md5 mode
    md5_only = dataclasses.replace(FULL, multipart=False, crc32c_put_verified=False,
                                   crc32c_multipart=False, md5_verified=False)
    assert choose(md5_only).integrity is IntegrityMode.MD5
    assert choose(dataclasses.replace(FULL, ranged_get=False)).integrity is None


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
    assert r.capabilities.multipart_list and r.capabilities.multipart_abort
    assert r.store_options() == {"integrity": want["integrity"].value,
                              "marker": want["marker"].value, "upload": "multipart"}
    assert any_s3_env.keys() == [] and any_s3_env.pending_uploads() == []  # scratch removed


def test_the_probe_is_cached_per_server(tmp_path: Path, any_s3_env: S3Env,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    local = Tier1Catalog(tmp_path)
    first = probe.probe_cached(local, any_s3_env.url)
    assert probe.cached(local, any_s3_env.url) == first  # the uploader reads this
    assert probe.cached(local, any_s3_env.url + "-other") is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # another server
    assert probe.cached(local, any_s3_env.url) is None


MINIMAL = {"no-multipart-listing": NO_MULTIPART_LISTING, "no-multipart": NO_MULTIPART}


@pytest.mark.parametrize("server", sorted(MINIMAL))
def test_501_to_an_optional_call_is_a_capability_not_an_outage(
        server: str, s3_env: S3Env, fault_proxy: Any, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """SeaweedFS behind the fault proxy, which answers 501 NotImplemented to the multipart
    calls a minimal server lacks: the probe answers (no StorageError), notes each 501 as
    "not supported", and picks single PUTs; its scratch keys are still removed."""
    rules = fault_proxy.not_implemented(MINIMAL[server])
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        r = probe.probe_cached(Tier1Catalog(tmp_path), s3_env.url)
    probe.require_usable(r, conditional_writes=True)
    assert not [m for m in caplog.messages if "did not answer" in m]
    c = r.capabilities
    assert (r.modes.integrity, r.modes.marker, r.modes.upload) == (
        IntegrityMode.CRC32C, MarkerMode.CREATE_ONLY, UploadMode.SINGLE_PUT)
    assert r.store_options() == {"integrity": "crc32c", "marker": "create-only",
                              "upload": "single-put"}
    assert c.multipart_list is False
    assert "list multipart uploads: not supported, NotImplemented (HTTP 501)" in c.notes
    if server == "no-multipart":
        assert c.multipart is False and c.multipart_abort is None
        assert any(n.startswith("multipart with Content-MD5: not supported, NotImplemented")
                   for n in c.notes), c.notes
    else:
        assert c.multipart is True and c.multipart_abort is False
        assert "abort a multipart upload: not supported, NotImplemented (HTTP 501)" in c.notes
    assert "listing multipart uploads" in r.modes.weaker[0]
    asked = {"list": rules[0].fired, "abort": rules[1].fired}
    if server == "no-multipart":
        asked["create"] = rules[2].fired
    # each asked once (botocore does not retry a 501), the sweep not at all
    assert asked == ({"list": 1, "abort": 0, "create": 2} if server == "no-multipart"
                     else {"list": 1, "abort": 1}), asked
    assert probe.cached(Tier1Catalog(tmp_path), s3_env.url) == r  # what the uploader reads
    assert s3_env.keys() == [] and s3_env.pending_uploads() == []  # nothing left behind


def test_a_server_error_on_an_optional_call_is_an_outage(s3_env: S3Env,
                                                        fault_proxy: Any) -> None:
    """A 500 (after botocore's retries) to listing multipart uploads is not "the server
    lacks it": the probe reports an outage and records nothing."""
    fault_proxy.add_rule("status", status=500, code="InternalError", times=None,
                         **LIST_UPLOADS)
    with pytest.raises(StorageError, match=r"list multipart uploads: InternalError \(HTTP 500"):
        probe.probe_url(s3_env.url, max_attempts=1)
    assert s3_env.keys() == []


def test_local_tier2_needs_no_probe(tmp_path: Path) -> None:
    r = probe.probe_url(tmp_path.as_uri())
    assert r.modes.integrity is IntegrityMode.CRC32C and r.store_options() == {}
