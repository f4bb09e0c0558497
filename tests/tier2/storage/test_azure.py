"""What is Azure-specific about the az:// backend, on Azurite: the credential chain and its
messages, the probe's answers, corrupted blocks and puts refused by the service (Content-MD5)
and resent, throttling (429/503 with Retry-After) retried with bounded attempts, and a lost
response to a create-only put. Faults come from the fault proxy in front of Azurite; every
one ends in a verified object or a loud error with nothing visible and no uncommitted
blocks left behind. The contract every backend passes is test_conformance.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from azure.core.exceptions import HttpResponseError
from azureserver import ACCOUNT_KEY, AzureEnv, connection_string
from faultproxy import FaultProxy

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import IntegrityMode, MarkerMode, UploadMode
from tierckpt.tier2.probe import probe_url, server_identity
from tierckpt.tier2.storage import BadDigestError, open_storage
from tierckpt.tier2.storage.azure import AzureConfig, AzureStorage
from tierckpt.tier2.storage.azureclient import READ_PIECE, error_code, open_range

MiB = 1024 * 1024
OPTIONS: dict[str, Any] = {"block_size": MiB, "single_put_threshold": 4 * MiB,
                           "max_concurrency": 2, "max_attempts": 4, "digest_attempts": 2,
                           "read_timeout_s": 2.0, "connect_timeout_s": 2.0, "backoff_s": 0.05}
PUT_BLOCK: dict[str, Any] = {"method": "PUT", "query": "blockid="}
PUT_BLOB: dict[str, Any] = {"method": "PUT", "not_query": "comp="}
GET_BLOB: dict[str, Any] = {"method": "GET", "not_query": "comp="}


# -- credentials and configuration (no server) -------------------------------------------
@pytest.fixture
def no_azure_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
                "AZURE_STORAGE_KEY"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_no_credentials_is_a_config_error_naming_the_variables(
        no_azure_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as ei:
        open_storage("az://tierckpt-test/p")
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
                "AZURE_STORAGE_KEY"):
        assert var in str(ei.value)


def test_credential_chain_and_its_errors(no_azure_env: pytest.MonkeyPatch) -> None:
    no_azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=s3cr3t-value;garbage")
    with pytest.raises(ConfigError, match="not a valid Azure Storage connection string") as ei:
        open_storage("az://tierckpt-test/p")
    assert "s3cr3t-value" not in str(ei.value)
    no_azure_env.delenv("AZURE_STORAGE_CONNECTION_STRING")
    no_azure_env.setenv("AZURE_STORAGE_ACCOUNT_NAME", "Not_An_Account")
    with pytest.raises(ConfigError, match="not a storage account name"):
        open_storage("az://tierckpt-test/p")
    no_azure_env.setenv("AZURE_STORAGE_ACCOUNT_NAME", "myaccount")
    try:
        import azure.identity  # noqa: F401
    except ImportError:  # the default credential chain needs azure-identity
        with pytest.raises(ConfigError, match=r"AZURE_STORAGE_KEY.*azure-identity"):
            open_storage("az://tierckpt-test/p")
    no_azure_env.setenv("AZURE_STORAGE_KEY", ACCOUNT_KEY)
    with open_storage("az://tierckpt-test/run-1") as st:  # no request is sent
        assert isinstance(st, AzureStorage) and st.url == "az://tierckpt-test/run-1"
        assert ACCOUNT_KEY not in st.url + repr(st)


def test_config_is_validated() -> None:
    for bad in ({"block_size": 1024}, {"single_put_threshold": -1}, {"max_attempts": 0},
                {"read_timeout_s": 0}, {"backoff_s": -1}):
        with pytest.raises(ConfigError, match="AzureConfig"):
            AzureConfig(**bad)
    with pytest.raises(ConfigError, match="unknown az:// storage option"):
        open_storage("az://tierckpt-test/p", part_size=5 * MiB)


# -- on Azurite ---------------------------------------------------------------------------
def test_wrong_key_fails_loudly_without_leaking_it(azure_env: AzureEnv,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = ACCOUNT_KEY[:-8] + "AAAAAAA="
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       connection_string(azure_env.server.endpoint).replace(ACCOUNT_KEY, wrong))
    with open_storage(azure_env.url, **OPTIONS) as st, pytest.raises(StorageError) as ei:
        st.put_bytes("k", b"x")
    msg = str(ei.value)
    assert "credentials refused" in msg and "403" in msg
    assert wrong not in msg and azure_env.server.endpoint not in msg
    with pytest.raises(ConfigError, match="credentials refused"):
        probe_url(azure_env.url)


def test_probe_answers_on_azurite(azure_env: AzureEnv) -> None:
    r = probe_url(azure_env.url)
    c = r.capabilities
    assert c.server == server_identity(azure_env.url)  # the account's endpoint + container
    assert c.server.endswith(f"/devstoreaccount1|{azure_env.url.split('/')[2]}")
    assert (c.basic_ops, c.ranged_get, c.multipart, c.multipart_list, c.multipart_abort) == (
        True, True, True, True, True)
    assert (c.md5_verified, c.etag_is_md5, c.if_none_match) == (True, False, True)
    assert (c.crc32c_put_verified, c.crc32c_head, c.crc32c_multipart) == (False, False, False)
    assert (r.modes.integrity, r.modes.marker, r.modes.upload) == (
        IntegrityMode.MD5, MarkerMode.CREATE_ONLY, UploadMode.MULTIPART)
    assert azure_env.keys(uncommitted=True) == []  # every scratch blob removed


def test_a_missing_container_is_a_config_error(azure_env: AzureEnv) -> None:
    with pytest.raises(ConfigError, match="container does not exist"):
        probe_url("az://no-such-container/p")


# -- faults ---------------------------------------------------------------------------------
RETRY_AFTER_S = 1
"""The ``Retry-After`` the proxy's throttling answers carry, as Azure's do."""


@pytest.fixture
def proxy(azure_fault_proxy: FaultProxy) -> FaultProxy:
    azure_fault_proxy.retry_after_s = RETRY_AFTER_S
    return azure_fault_proxy


@pytest.fixture
def store(azure_env: AzureEnv, proxy: FaultProxy) -> Any:
    with open_storage(azure_env.url, **OPTIONS) as st:
        assert isinstance(st, AzureStorage)
        yield st


def make_file(tmp_path: Path, size: int) -> tuple[Path, bytes, int]:
    data = os.urandom(size)
    p = tmp_path / f"src-{size}"
    p.write_bytes(data)
    return p, data, checksum.extend(0, data)


def assert_stored(env: AzureEnv, key: str, data: bytes, crc: int) -> None:
    """Read back directly from Azurite (no proxy, no tierckpt code)."""
    blob = env.server.container_client().get_blob_client(f"{env.prefix}/{key}")
    assert blob.download_blob().readall() == data
    assert blob.get_blob_properties().metadata["tierckpt_crc32c"] == checksum.to_hex(crc)
    assert env.keys(uncommitted=True) == env.keys()  # no uncommitted blocks left over


UPLOAD_FAULTS = {
    "flipped byte in block 3 (Md5Mismatch, resent)": dict(action="corrupt", skip=2,
                                                          **PUT_BLOCK),
    "429 with Retry-After on a block": dict(action="status", status=429,
                                            code="TooManyRequests", **PUT_BLOCK),
    "503 ServerBusy with Retry-After on the commit": dict(
        action="status", status=503, code="ServerBusy", method="PUT", query="comp=blocklist"),
    "reset after 100 KiB of a block": dict(action="reset", after_bytes=100 * 1024,
                                           **PUT_BLOCK),
}


@pytest.mark.parametrize("fault", UPLOAD_FAULTS.values(), ids=UPLOAD_FAULTS.keys())
def test_block_upload_survives(store: AzureStorage, azure_env: AzureEnv, proxy: FaultProxy,
                               tmp_path: Path, fault: dict[str, Any]) -> None:
    src, data, crc = make_file(tmp_path, 6 * MiB + 77)  # 7 blocks of 1 MiB
    rule = proxy.add_rule(**fault)
    t0 = time.monotonic()
    info = store.put_file("step-00000001/__0_0.distcp", src, crc32c=crc, size=len(data))
    assert rule.fired == rule.times, proxy.hits
    if fault["action"] == "status":  # the server's Retry-After was waited, every time
        assert time.monotonic() - t0 >= RETRY_AFTER_S * rule.fired
        refused, waited = store.throttled.snapshot()  # and counted, for `tierckpt report`
        assert refused == rule.fired and waited >= RETRY_AFTER_S * rule.fired
    assert (info.size, info.crc32c) == (len(data), crc)
    assert_stored(azure_env, "step-00000001/__0_0.distcp", data, crc)


def test_persistent_block_corruption_fails_with_nothing_left(
        store: AzureStorage, azure_env: AzureEnv, proxy: FaultProxy, tmp_path: Path) -> None:
    src, data, crc = make_file(tmp_path, 6 * MiB)
    rule = proxy.add_rule("corrupt", times=None, skip=1, **PUT_BLOCK)
    with pytest.raises(BadDigestError, match="Md5Mismatch"):
        store.put_file("k/big", src, crc32c=crc, size=len(data))
    assert rule.fired >= 2  # the corrupted block was sent again (digest_attempts=2)
    assert azure_env.keys(uncommitted=True) == []  # not visible, no blocks kept


def test_persistent_put_corruption_fails_without_the_marker(
        store: AzureStorage, azure_env: AzureEnv, proxy: FaultProxy) -> None:
    proxy.add_rule("corrupt", times=None, **PUT_BLOB)
    with pytest.raises(BadDigestError):
        store.put_bytes("step-00000001/COMPLETE", b"marker body", if_none_match=True)
    assert azure_env.keys(uncommitted=True) == []


def test_persistent_throttling_gives_up_after_max_attempts(
        store: AzureStorage, azure_env: AzureEnv, proxy: FaultProxy,
        tmp_path: Path) -> None:
    proxy.retry_after_s = 0
    src, data, crc = make_file(tmp_path, 6 * MiB)
    rule = proxy.add_rule("status", status=503, code="ServerBusy", times=None, **PUT_BLOCK)
    with pytest.raises(StorageError, match=r"ServerBusy \(HTTP 503\)"):
        store.put_file("k/big", src, crc32c=crc, size=len(data))
    # Each block sent max_attempts times, no more, and the upload stops well before all 7
    # blocks: the blocks started before the queue was cancelled run to the end — one per
    # worker, and one more per worker that freed itself before the caller saw the first
    # failure and cancelled the rest (seen: 4 blocks with 2 workers).
    n = OPTIONS["max_attempts"]
    assert rule.fired % n == 0 and rule.fired <= 2 * OPTIONS["max_concurrency"] * n < 7 * n
    assert azure_env.keys(uncommitted=True) == []


def test_a_stalled_put_times_out_and_is_retried(azure_env: AzureEnv, proxy: FaultProxy,
                                                tmp_path: Path) -> None:
    src, data, crc = make_file(tmp_path, 300_000)
    rule = proxy.add_rule("hang", **PUT_BLOB)
    with open_storage(azure_env.url, **{**OPTIONS, "read_timeout_s": 1.0}) as st:
        st.put_file("k/small", src, crc32c=crc, size=len(data))
    assert rule.fired == 1
    assert_stored(azure_env, "k/small", data, crc)


def test_create_only_put_stored_but_response_lost_is_success(
        store: AzureStorage, azure_env: AzureEnv, proxy: FaultProxy) -> None:
    rule = proxy.add_rule("reset_after_store", **PUT_BLOB)
    store.put_bytes("step-00000001/COMPLETE", b"marker", if_none_match=True)
    assert rule.fired == 1 and "pass" in proxy.actions()
    # The retry met 409 BlobAlreadyExists on our own earlier write and read it back.
    assert azure_env.keys() == ["step-00000001/COMPLETE"]


def test_downloads_are_verified_and_retried(store: AzureStorage, azure_env: AzureEnv,
                                            proxy: FaultProxy, tmp_path: Path) -> None:
    src, data, crc = make_file(tmp_path, 3 * MiB + 5)
    store.put_file("obj", src, crc32c=crc, size=len(data))
    rule = proxy.add_rule("corrupt_response", skip=1, **GET_BLOB)  # one range flipped once
    assert store.get_file("obj", tmp_path / "dl").crc32c == crc
    assert rule.fired == 1 and (tmp_path / "dl").read_bytes() == data
    proxy.add_rule("reset_response", after_bytes=1000, **GET_BLOB)  # a body broke off
    assert store.get_range("obj", 10, 2 * MiB) == data[10:10 + 2 * MiB]
    proxy.add_rule("corrupt_response", times=None, **GET_BLOB)
    with pytest.raises(BadDigestError):
        store.get_file("obj", tmp_path / "dl2")
    assert not (tmp_path / "dl2").exists()


# -- ranged reads: the direct path and the public one, pinned to the ETag -----------------
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "download_blob"])
def test_open_range_reads_the_range_pinned_to_the_etag(azure_env: AzureEnv,
                                                       direct: bool) -> None:
    data = os.urandom(READ_PIECE + 3 * MiB + 5)
    blob = azure_env.server.container_client().get_blob_client(f"{azure_env.prefix}/obj")
    blob.upload_blob(data)
    etag = blob.get_blob_properties().etag
    sent, body = open_range(blob, 10, READ_PIECE + MiB, etag, direct=direct)
    pieces = list(body)
    assert sent == READ_PIECE + MiB and b"".join(pieces) == data[10:10 + READ_PIECE + MiB]
    assert all(len(p) <= READ_PIECE for p in pieces) or not direct
    sent, body = open_range(blob, len(data) - 5, 100, None, direct=direct)  # ends past the end
    body.close()  # not read: the connection is dropped, not reused half-read
    assert sent == 5
    blob.upload_blob(b"replaced", overwrite=True)
    with pytest.raises(HttpResponseError) as ei:  # the old version is gone: refused
        sent, body = open_range(blob, 0, MiB, etag, direct=direct)
        list(body)
    assert (ei.value.status_code, error_code(ei.value)) == (412, "ConditionNotMet")


def test_a_blob_replaced_mid_download_fails_instead_of_mixing(
        store: AzureStorage, azure_env: AzureEnv, proxy: FaultProxy, tmp_path: Path) -> None:
    src, data, crc = make_file(tmp_path, 3 * MiB)  # 3 ranges of 1 MiB, 2 at a time
    store.put_file("obj", src, crc32c=crc, size=len(data))
    rule = proxy.add_rule("delay", hang_s=1.0, skip=1, times=None, **GET_BLOB)
    blob = azure_env.server.container_client().get_blob_client(f"{azure_env.prefix}/obj")

    def replace_while_delayed() -> None:
        while rule.fired == 0:
            time.sleep(0.01)
        blob.upload_blob(os.urandom(len(data)), overwrite=True)  # straight to Azurite

    t = threading.Thread(target=replace_while_delayed)
    t.start()
    try:
        with pytest.raises(StorageError, match=r"ConditionNotMet \(HTTP 412\)"):
            store.get_file("obj", tmp_path / "dl", crc32c=crc)
    finally:
        t.join(10)
    assert not (tmp_path / "dl").exists() and list(tmp_path.glob("*tierckpt-tmp*")) == []
