"""S3 backend under injected network faults (faultproxy in front of real SeaweedFS).

Every fault must end in one of two ways: a verified object (the bytes read back directly
from the server match, HeadObject reports the CRC32C), or a loud StorageError with no
object and no unfinished multipart upload left behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from faultproxy import COMPLETE, GET, PUT_OBJECT, UPLOAD_PART, FaultProxy
from s3server import S3Env

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.storage import BadDigestError, open_storage
from tierckpt.tier2.storage.s3 import S3Storage

MiB = 1024 * 1024
OPTIONS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 2,
           "max_attempts": 4, "digest_attempts": 2, "read_timeout_s": 2.0,
           "connect_timeout_s": 2.0}


@pytest.fixture
def store(s3_env: S3Env, fault_proxy: FaultProxy) -> Any:
    st = open_storage(s3_env.url, **OPTIONS)
    assert isinstance(st, S3Storage)
    with st:
        yield st


def make_file(tmp_path: Path, size: int) -> tuple[Path, bytes, int]:
    data = os.urandom(size)
    p = tmp_path / f"src-{size}"
    p.write_bytes(data)
    return p, data, checksum.extend(0, data)


def assert_stored(env: S3Env, key: str, data: bytes, crc: int) -> None:
    """Read back directly from the server (no proxy, no tierckpt code)."""
    c = env.client()
    full = f"{env.prefix}/{key}"
    assert c.get_object(Bucket=env.bucket, Key=full)["Body"].read() == data
    h = c.head_object(Bucket=env.bucket, Key=full, ChecksumMode="ENABLED")
    assert h["ChecksumCRC32C"] == checksum.to_b64(crc)
    assert env.pending_uploads() == []


def assert_nothing(env: S3Env) -> None:
    assert env.keys() == []
    assert env.pending_uploads() == []


MULTIPART_FAULTS = {
    "503 SlowDown on first 2 UploadPart": dict(action="status", status=503, code="SlowDown",
                                               times=2, **UPLOAD_PART),
    "500 on Complete once": dict(action="status", status=500, code="InternalError", **COMPLETE),
    "reset after 1 MiB of an UploadPart body": dict(action="reset", after_bytes=MiB,
                                                    **UPLOAD_PART),
    "reset after the part was stored": dict(action="reset_after_store", **UPLOAD_PART),
    "reset after Complete was stored": dict(action="reset_after_store", **COMPLETE),
    "stalled UploadPart": dict(action="hang", **UPLOAD_PART),
    "flipped byte in UploadPart 2": dict(action="corrupt", skip=1, **UPLOAD_PART),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", MULTIPART_FAULTS.values(), ids=MULTIPART_FAULTS.keys())
def test_multipart_upload_survives(store: S3Storage, s3_env: S3Env, fault_proxy: FaultProxy,
                                   tmp_path: Path, fault: dict[str, Any]) -> None:
    src, data, crc = make_file(tmp_path, 6 * MiB + 777)
    rule = fault_proxy.add_rule(**fault)
    info = store.put_file("step-00000001/__0_0.distcp", src, crc32c=crc, size=len(data))
    assert rule.fired >= 1, fault_proxy.hits
    assert (info.size, info.crc32c) == (len(data), crc)
    assert_stored(s3_env, "step-00000001/__0_0.distcp", data, crc)


SINGLE_FAULTS = {
    "503 twice": dict(action="status", status=503, code="SlowDown", times=2, **PUT_OBJECT),
    "reset mid-body": dict(action="reset", after_bytes=1000, **PUT_OBJECT),
    "reset after stored": dict(action="reset_after_store", **PUT_OBJECT),
    "flipped byte": dict(action="corrupt", **PUT_OBJECT),
    "stalled": dict(action="hang", **PUT_OBJECT),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", SINGLE_FAULTS.values(), ids=SINGLE_FAULTS.keys())
def test_single_put_survives(store: S3Storage, s3_env: S3Env, fault_proxy: FaultProxy,
                             tmp_path: Path, fault: dict[str, Any]) -> None:
    src, data, crc = make_file(tmp_path, 300_000)
    rule = fault_proxy.add_rule(**fault)
    store.put_file("k/manifest-like", src, crc32c=crc, size=len(data))
    assert rule.fired == rule.times
    assert_stored(s3_env, "k/manifest-like", data, crc)


def test_create_only_marker_stored_but_response_lost_is_success(
        store: S3Storage, s3_env: S3Env, fault_proxy: FaultProxy) -> None:
    rule = fault_proxy.add_rule("reset_after_store", **PUT_OBJECT)
    store.put_bytes("step-00000001/COMPLETE", b"marker", if_none_match=True)
    assert rule.fired == 1
    # The retry met 412 on our own earlier write and recognised it as ours.
    assert "pass" in fault_proxy.actions()
    assert s3_env.keys() == ["step-00000001/COMPLETE"]


def test_persistent_corruption_fails_loudly_with_nothing_left(
        store: S3Storage, s3_env: S3Env, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    src, data, crc = make_file(tmp_path, 6 * MiB)
    fault_proxy.add_rule("corrupt", times=None, skip=1, **UPLOAD_PART)
    with pytest.raises(BadDigestError):
        store.put_file("k/big", src, crc32c=crc, size=len(data))
    assert_nothing(s3_env)


@pytest.mark.slow
def test_persistent_slowdown_fails_loudly_with_nothing_left(
        s3_env: S3Env, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    src, data, crc = make_file(tmp_path, 6 * MiB)
    rule = fault_proxy.add_rule("status", status=503, code="SlowDown", times=None,
                                **UPLOAD_PART)
    with open_storage(s3_env.url, **{**OPTIONS, "max_attempts": 2}) as impatient, \
            pytest.raises(StorageError) as ei:
        impatient.put_file("k/big", src, crc32c=crc, size=len(data))
    assert "SlowDown" in str(ei.value)
    assert rule.fired >= 2  # botocore retried before giving up
    assert_nothing(s3_env)


def test_persistent_corrupt_marker_put_fails_without_marker(
        store: S3Storage, s3_env: S3Env, fault_proxy: FaultProxy) -> None:
    fault_proxy.add_rule("corrupt", times=None, **PUT_OBJECT)
    with pytest.raises(BadDigestError):
        store.put_bytes("step-00000001/COMPLETE", b"marker body", if_none_match=True)
    assert_nothing(s3_env)


@pytest.fixture
def big_object(s3_env: S3Env, tmp_path: Path) -> tuple[str, bytes, int]:
    """An 11 MiB object (3 ranges of <= 5 MiB) uploaded directly, not through the proxy."""
    data = os.urandom(11 * MiB)
    crc = checksum.extend(0, data)
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=f"{s3_env.prefix}/obj", Body=data,
                               ChecksumCRC32C=checksum.to_b64(crc))
    return "obj", data, crc


DOWNLOAD_FAULTS = {
    "503 on first 2 GETs": dict(action="status", status=503, code="SlowDown", times=2, **GET),
    "reset after 1 MiB of a GET body": dict(action="reset_response", after_bytes=MiB, **GET),
    "flipped byte in a GET body": dict(action="corrupt_response", skip=1, **GET),
    "stalled GET": dict(action="hang", **GET),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", DOWNLOAD_FAULTS.values(), ids=DOWNLOAD_FAULTS.keys())
def test_download_survives(store: S3Storage, fault_proxy: FaultProxy, tmp_path: Path,
                           big_object: tuple[str, bytes, int], fault: dict[str, Any]) -> None:
    key, data, crc = big_object
    rule = fault_proxy.add_rule(**fault)
    info = store.get_file(key, tmp_path / "dl")
    assert rule.fired == rule.times
    assert (tmp_path / "dl").read_bytes() == data
    assert info.crc32c == crc


def test_download_persistent_corruption_is_bad_digest(
        store: S3Storage, fault_proxy: FaultProxy, tmp_path: Path,
        big_object: tuple[str, bytes, int]) -> None:
    key, _, crc = big_object
    fault_proxy.add_rule("corrupt_response", times=None, **GET)
    with pytest.raises(BadDigestError):
        store.get_file(key, tmp_path / "dl", crc32c=crc)
    assert not (tmp_path / "dl").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_wrong_credentials_fail_without_leaking_them(s3_env: S3Env,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-xyz")
    with open_storage(s3_env.url, **OPTIONS) as st, pytest.raises(StorageError) as ei:
        st.put_bytes("k", b"x")
    msg = str(ei.value)
    assert "SignatureDoesNotMatch" in msg or "AccessDenied" in msg or "403" in msg
    assert "wrong-secret-value-xyz" not in msg and s3_env.server.endpoint not in msg
