"""What is particular to the Google Cloud Storage backend, on the emulator (fake-gcs-server):
credentials and endpoint errors, configuration, the probe's answers, and faults injected by
tests/faultproxy.py between the SDK and the emulator — corrupted uploads and downloads,
throttling with ``Retry-After``, a lost response to a create-only put.

Every fault ends in a verified object (read back directly from the emulator) or a loud
error with nothing left under the prefix, temporaries included. Both integrity modes run:
``md5`` (what the probe picks for the emulator: temporary name, compare, compose) and
``crc32c`` (GCS's mode; the emulator does not check the declared CRC32C, so this also shows
that the reported-CRC32C check after every upload catches what the server let through).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy
from gcsserver import GCSEnv, env_without_gcs_credentials

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier2.probe import probe_url
from tierckpt.tier2.storage import BadDigestError, open_storage
from tierckpt.tier2.storage.gcs import GCSConfig, GCSStorage

MiB = 1024 * 1024
OPTIONS = {"part_size": 2 * MiB, "single_upload_threshold": 5 * MiB, "max_concurrency": 2,
           "max_attempts": 4, "digest_attempts": 2, "read_timeout_s": 2.0,
           "connect_timeout_s": 2.0, "max_backoff_s": 2.0}
UPLOAD: dict[str, Any] = {"method": "POST", "path": "/upload/storage/v1/"}
CREATE_ONLY: dict[str, Any] = {**UPLOAD, "query": "ifGenerationMatch=0"}
DOWNLOAD: dict[str, Any] = {"method": "GET", "path": "/download/storage/v1/"}


@pytest.fixture
def proxy(gcs_env: GCSEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """The proxy in front of the emulator; storage opened afterwards goes through it
    (``gcs_env`` still reads the emulator directly)."""
    host, port = gcs_env.server.endpoint.removeprefix("http://").rsplit(":", 1)
    with FaultProxy(host, int(port), dialect="gcs", retry_after_s=0) as p:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.endpoint)
        yield p


def _store(env: GCSEnv, integrity: str, **kw: Any) -> GCSStorage:
    st = open_storage(env.url, **{**OPTIONS, "integrity": integrity, **kw})
    assert isinstance(st, GCSStorage)
    return st


def _file(tmp_path: Path, size: int) -> tuple[Path, bytes, int]:
    data = os.urandom(size)
    p = tmp_path / f"src-{size}"
    p.write_bytes(data)
    return p, data, checksum.extend(0, data)


def _stored(env: GCSEnv, key: str) -> bytes:
    """The object's bytes, read from the emulator directly (no proxy, no tierckpt code)."""
    return bytes(env.bucket().blob(f"{env.prefix}/{key}").download_as_bytes())


# -- configuration and credentials -----------------------------------------------------------
def test_no_credentials_and_no_emulator_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env_without_gcs_credentials(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match=r"no Google credentials.*STORAGE_EMULATOR_HOST"):
        open_storage("gs://some-bucket/run")


def test_malformed_emulator_host_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    with pytest.raises(ConfigError, match=r"http://127\.0\.0\.1:4443"):
        open_storage("gs://some-bucket/run")


@pytest.mark.parametrize("bad", [{"part_size": 1024}, {"integrity": "sha1"},
                                 {"max_attempts": 0}, {"read_timeout_s": 0},
                                 {"single_upload_threshold": -1}])
def test_config_is_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=f"GCSConfig.{next(iter(bad))}"):
        GCSConfig(**bad)


def test_unknown_option_and_missing_bucket(gcs_env: GCSEnv) -> None:
    with pytest.raises(ConfigError, match="unknown gs:// storage option"):
        open_storage(gcs_env.url, no_such_option=1)
    with pytest.raises(ConfigError, match="bucket does not exist"):
        probe_url("gs://no-such-bucket-x/p")


# -- the probe -------------------------------------------------------------------------------
def test_probe_answers_on_the_emulator(gcs_env: GCSEnv) -> None:
    r = probe_url(gcs_env.url)
    c = r.capabilities
    assert (c.basic_ops, c.ranged_get, c.multipart, c.multipart_list, c.multipart_abort) == \
        (True, True, True, True, True)
    assert (c.crc32c_head, c.crc32c_multipart, c.etag_is_md5, c.if_none_match) == \
        (True, True, True, True)
    # fake-gcs-server 1.54 stores bytes whatever CRC32C or MD5 the upload declares (GCS
    # refuses them), and ignores a compose's source generation precondition.
    assert (c.crc32c_put_verified, c.md5_verified) == (False, False)
    assert "upload with a wrong CRC32C: accepted" in c.notes
    assert any("compose" in n and "ignored" in n for n in c.notes)
    assert (r.modes.integrity.value if r.modes.integrity else None,
            r.modes.marker.value, r.modes.upload.value) == ("md5", "create-only", "multipart")
    assert gcs_env.names() == []  # the probe cleaned up after itself


# -- corruption ------------------------------------------------------------------------------
@pytest.mark.parametrize("integrity", ["md5", "crc32c"])
@pytest.mark.parametrize("size", [300_000, 6 * MiB + 5])
def test_one_corrupted_upload_is_caught_and_sent_again(
        gcs_env: GCSEnv, proxy: FaultProxy, tmp_path: Path, integrity: str,
        size: int) -> None:
    src, data, crc = _file(tmp_path, size)
    rule = proxy.add_rule("corrupt", skip=1 if size > MiB else 0, **UPLOAD)
    with _store(gcs_env, integrity) as st:
        info = st.put_file("step-00000001/__0_0.distcp", src, crc32c=crc, size=size)
    assert rule.fired == 1 and (info.size, info.crc32c) == (size, crc)
    assert _stored(gcs_env, "step-00000001/__0_0.distcp") == data
    assert gcs_env.names() == ["step-00000001/__0_0.distcp"]  # no temporaries left


@pytest.mark.parametrize("integrity", ["md5", "crc32c"])
@pytest.mark.parametrize("size", [300_000, 6 * MiB + 5])
def test_persistent_corruption_fails_loudly_and_leaves_nothing(
        gcs_env: GCSEnv, proxy: FaultProxy, tmp_path: Path, integrity: str,
        size: int) -> None:
    src, _, crc = _file(tmp_path, size)
    proxy.add_rule("corrupt", times=None, **UPLOAD)
    with _store(gcs_env, integrity) as st, pytest.raises(BadDigestError):
        st.put_file("k/obj", src, crc32c=crc, size=size)
    assert gcs_env.names() == []


@pytest.mark.parametrize("integrity", ["md5", "crc32c"])
def test_corrupted_create_only_marker_leaves_no_marker(
        gcs_env: GCSEnv, proxy: FaultProxy, integrity: str) -> None:
    proxy.add_rule("corrupt", times=None, **CREATE_ONLY)
    with _store(gcs_env, integrity) as st, pytest.raises(BadDigestError):
        st.put_bytes("step-00000001/COMPLETE", b"marker body " * 400, if_none_match=True)
    assert gcs_env.names() == []


def test_corrupted_download_is_fetched_again_or_refused(
        gcs_env: GCSEnv, proxy: FaultProxy, tmp_path: Path) -> None:
    src, data, crc = _file(tmp_path, 5 * MiB)
    with _store(gcs_env, "md5") as st:
        st.put_file("obj", src, crc32c=crc, size=len(data))
        rule = proxy.add_rule("corrupt_response", skip=1, **DOWNLOAD)
        assert st.get_file("obj", tmp_path / "dl").crc32c == crc
        assert rule.fired == 1 and (tmp_path / "dl").read_bytes() == data
        proxy.add_rule("corrupt_response", times=None, **DOWNLOAD)
        with pytest.raises(BadDigestError):
            st.get_file("obj", tmp_path / "dl2", crc32c=crc)
    assert not (tmp_path / "dl2").exists()


# -- throttling and lost responses -----------------------------------------------------------
def test_429_with_retry_after_is_waited_out(gcs_env: GCSEnv, proxy: FaultProxy) -> None:
    proxy.retry_after_s = 1
    rule = proxy.add_rule("status", status=429, code="rateLimitExceeded", **UPLOAD)
    with _store(gcs_env, "crc32c") as st:
        t0 = time.monotonic()
        st.put_bytes("k/manifest.json", b"{}")
        waited = time.monotonic() - t0
        refused, throttled_s = st.throttled.snapshot()  # counted, for `tierckpt report`
    assert rule.fired == 1 and waited >= 0.9  # the server's Retry-After, not 0.1 s backoff
    assert refused == 1 and throttled_s >= 0.9
    assert _stored(gcs_env, "k/manifest.json") == b"{}"


def test_503s_on_ranged_downloads_are_retried(gcs_env: GCSEnv, proxy: FaultProxy,
                                              tmp_path: Path) -> None:
    src, data, crc = _file(tmp_path, 5 * MiB)
    with _store(gcs_env, "crc32c") as st:
        st.put_file("obj", src, crc32c=crc, size=len(data))
        rule = proxy.add_rule("status", status=503, code="backendError", times=2, **DOWNLOAD)
        assert st.get_range("obj", MiB, 3 * MiB) == data[MiB:4 * MiB]
    assert rule.fired == 2


def test_persistent_503_fails_after_bounded_attempts_without_secrets(
        gcs_env: GCSEnv, proxy: FaultProxy, tmp_path: Path) -> None:
    src, _, crc = _file(tmp_path, 300_000)
    rule = proxy.add_rule("status", status=503, code="backendError", times=None, **UPLOAD)
    with _store(gcs_env, "crc32c") as st, pytest.raises(StorageError, match=r"HTTP 503") as ei:
        st.put_file("k/obj", src, crc32c=crc, size=300_000)
    assert rule.fired == OPTIONS["max_attempts"]
    assert proxy.endpoint not in str(ei.value) and gcs_env.server.endpoint not in str(ei.value)
    assert gcs_env.names() == []


def test_create_only_put_stored_but_response_lost_is_success(
        gcs_env: GCSEnv, proxy: FaultProxy) -> None:
    rule = proxy.add_rule("reset_after_store", **CREATE_ONLY)
    with _store(gcs_env, "crc32c") as st:
        st.put_bytes("step-00000001/COMPLETE", b"marker", if_none_match=True)
    # the retry met 412 on our own earlier write and read it back
    assert rule.fired == 1 and gcs_env.names() == ["step-00000001/COMPLETE"]
