"""One contract, every backend: local directory, in-memory, and S3 on two real servers
(SeaweedFS in crc32c mode, moto's server in md5 mode), and Azure Blob Storage on Azurite,
and Google Cloud Storage on its emulator (fake-gcs-server, in the mode its probe picks: md5).

Objects stay small; the S3 backend runs with 5 MiB parts so a 6 MiB file exercises the
multipart path (parallel parts, FULL_OBJECT CRC32C, verified by the server); the Azure
backend runs with 1 MiB blocks above 4 MiB, so the same file goes in seven staged blocks; the
GCS backend with 2 MiB parts above 5 MiB, so it goes in four parts composed into one object.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from azureserver import AzureEnv
from gcsserver import GCSEnv
from s3server import S3Env, _env_for

from tierckpt.errors import ConfigError, IntegrityError, StorageError
from tierckpt.format import checksum
from tierckpt.tier2.probe import probe_url
from tierckpt.tier2.storage import (
    BadDigestError,
    LocalStorage,
    MemoryStorage,
    ObjectExistsError,
    ObjectNotFoundError,
    Storage,
    open_storage,
)
from tierckpt.tier2.storage.base import TMP_MARK

MiB = 1024 * 1024
S3_ENVS: dict[str, S3Env] = {}  # an S3 storage's url -> its server and prefix
S3_TEST_OPTIONS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 4,
                   "digest_attempts": 2, "read_timeout_s": 10.0, "connect_timeout_s": 2.0}
GCS_ENVS: dict[str, GCSEnv] = {}  # a GCS storage's url -> its emulator and prefix
GCS_TEST_OPTIONS = {"part_size": 2 * MiB, "single_upload_threshold": 5 * MiB,
                    "max_concurrency": 4, "digest_attempts": 2, "read_timeout_s": 10.0,
                    "connect_timeout_s": 2.0}
GCS_INTEGRITY: dict[str, str] = {}  # emulator endpoint -> the integrity mode its probe chose
AZURE_ENVS: dict[str, AzureEnv] = {}  # an Azure storage's url -> its emulator and prefix
AZURE_TEST_OPTIONS = {"block_size": MiB, "single_put_threshold": 4 * MiB,
                      "max_concurrency": 4, "digest_attempts": 2, "read_timeout_s": 10.0,
                      "connect_timeout_s": 2.0}


@pytest.fixture(params=["local", "memory", "s3", "moto", "azure", "gcs"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        (tmp_path / "store").mkdir()  # a file:// tier 2 must exist: opening one never creates it
        st: Storage = open_storage((tmp_path / "store").as_uri())
    elif request.param == "memory":
        st = open_storage("memory://conformance")
    elif request.param == "s3":
        env = request.getfixturevalue("s3_env")
        st = open_storage(env.url, **S3_TEST_OPTIONS)
        S3_ENVS[st.url] = env
    elif request.param == "azure":  # Azurite
        aenv = request.getfixturevalue("azure_env")
        st = open_storage(aenv.url, **AZURE_TEST_OPTIONS)
        AZURE_ENVS[st.url] = aenv
    elif request.param == "gcs":  # the emulator, in the integrity mode its probe chooses
        genv = request.getfixturevalue("gcs_env")
        if genv.server.endpoint not in GCS_INTEGRITY:
            mode = probe_url(genv.url).modes.integrity
            assert mode is not None
            GCS_INTEGRITY[genv.server.endpoint] = mode.value
        st = open_storage(genv.url, **GCS_TEST_OPTIONS,
                          integrity=GCS_INTEGRITY[genv.server.endpoint])
        GCS_ENVS[st.url] = genv
    else:  # moto's server, in the integrity mode its probe chooses (md5)
        env = _env_for(request.getfixturevalue("moto_server"),
                       request.getfixturevalue("monkeypatch"))
        st = open_storage(env.url, **S3_TEST_OPTIONS, **probe_url(env.url).store_options())
        S3_ENVS[st.url] = env
    with st:
        yield st


def write(path: Path, data: bytes) -> tuple[Path, int]:
    path.write_bytes(data)
    return path, checksum.extend(0, data)


def test_is_a_storage(storage: Storage) -> None:
    assert isinstance(storage, Storage)
    assert "://" in storage.url


@pytest.mark.parametrize("size", [0, 1000, 6 * MiB + 123])
def test_put_file_head_get_file_roundtrip(storage: Storage, tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    src, crc = write(tmp_path / "src", data)
    info = storage.put_file("step-00000001/__0_0.distcp", src, crc32c=crc, size=size)
    assert (info.size, info.crc32c) == (size, crc)
    head = storage.head("step-00000001/__0_0.distcp")
    assert head is not None and head.size == size
    assert head.crc32c in (crc, None) if isinstance(storage, LocalStorage) else head.crc32c == crc
    dest = tmp_path / "out" / "copy"
    got = storage.get_file("step-00000001/__0_0.distcp", dest, crc32c=crc)
    assert dest.read_bytes() == data
    assert (got.size, got.crc32c) == (size, crc)
    assert not [p for p in dest.parent.iterdir() if TMP_MARK in p.name]


def test_put_file_wrong_crc_is_bad_digest_and_leaves_nothing(storage: Storage,
                                                             tmp_path: Path) -> None:
    src, crc = write(tmp_path / "src", os.urandom(4096))
    with pytest.raises(BadDigestError) as ei:
        storage.put_file("k/bad", src, crc32c=crc ^ 1, size=4096)
    assert isinstance(ei.value, IntegrityError) and isinstance(ei.value, StorageError)
    assert storage.head("k/bad") is None
    assert storage.list("k/") == []


def test_multipart_wrong_crc_leaves_no_object_and_no_upload(storage: Storage,
                                                            tmp_path: Path) -> None:
    src, crc = write(tmp_path / "src", os.urandom(6 * MiB))
    with pytest.raises(BadDigestError):
        storage.put_file("k/big", src, crc32c=crc ^ 0x100, size=6 * MiB)
    assert storage.head("k/big") is None
    assert storage.abort_uploads("k/") == 0  # nothing was left behind to abort


def test_put_file_wrong_size_is_bad_digest(storage: Storage, tmp_path: Path) -> None:
    src, crc = write(tmp_path / "src", b"abc")
    with pytest.raises(BadDigestError):
        storage.put_file("k/x", src, crc32c=crc, size=4)
    assert storage.head("k/x") is None


def test_put_file_replaces_atomically(storage: Storage, tmp_path: Path) -> None:
    a, ca = write(tmp_path / "a", b"first version")
    b, cb = write(tmp_path / "b", b"second")
    storage.put_file("k/obj", a, crc32c=ca, size=13)
    storage.put_file("k/obj", b, crc32c=cb, size=6)
    assert storage.get_bytes("k/obj") == b"second"
    assert [i.key for i in storage.list("k/")] == ["k/obj"]


def test_put_bytes_get_bytes(storage: Storage) -> None:
    info = storage.put_bytes("a/manifest.json", b'{"x": 1}\n')
    assert info.crc32c == checksum.extend(0, b'{"x": 1}\n') and info.size == 9
    assert storage.get_bytes("a/manifest.json") == b'{"x": 1}\n'
    head = storage.head("a/manifest.json")
    assert head is not None and head.size == 9
    storage.put_bytes("a/manifest.json", b"new")
    assert storage.get_bytes("a/manifest.json") == b"new"


def test_create_only_put(storage: Storage) -> None:
    storage.put_bytes("s/COMPLETE", b"marker-1", if_none_match=True)
    # The same bytes again succeed: a retry after a lost response is idempotent.
    storage.put_bytes("s/COMPLETE", b"marker-1", if_none_match=True)
    with pytest.raises(ObjectExistsError) as ei:
        storage.put_bytes("s/COMPLETE", b"marker-2", if_none_match=True)
    assert isinstance(ei.value, FileExistsError)
    assert storage.get_bytes("s/COMPLETE") == b"marker-1"


def test_create_only_race_has_one_winner(storage: Storage) -> None:
    results: dict[int, str] = {}

    def attempt(i: int) -> None:
        try:
            storage.put_bytes("race/COMPLETE", f"writer-{i}".encode(), if_none_match=True)
            results[i] = "won"
        except ObjectExistsError:
            results[i] = "lost"

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in results.items() if r == "won"]
    assert len(results) == 4 and len(winners) == 1
    assert storage.get_bytes("race/COMPLETE") == f"writer-{winners[0]}".encode()


def test_missing_objects(storage: Storage, tmp_path: Path) -> None:
    assert storage.head("no/such") is None
    with pytest.raises(ObjectNotFoundError) as ei:
        storage.get_bytes("no/such")
    assert isinstance(ei.value, FileNotFoundError)
    with pytest.raises(ObjectNotFoundError):
        storage.get_file("no/such", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_get_file_verifies_expected_crc(storage: Storage, tmp_path: Path) -> None:
    src, crc = write(tmp_path / "src", os.urandom(2048))
    storage.put_file("k/f", src, crc32c=crc, size=2048)
    (tmp_path / "dest").write_bytes(b"old content")
    with pytest.raises(BadDigestError):
        storage.get_file("k/f", tmp_path / "dest", crc32c=crc ^ 1)
    assert (tmp_path / "dest").read_bytes() == b"old content"  # never replaced by bad bytes
    assert [p.name for p in tmp_path.iterdir() if TMP_MARK in p.name] == []


def test_list_prefix_sorted_and_delete(storage: Storage, tmp_path: Path) -> None:
    for key in ["b/2", "a/1", "ab/3", "a/sub/4", "step-00000010/.metadata"]:
        storage.put_bytes(key, key.encode())
    assert [i.key for i in storage.list("a/")] == ["a/1", "a/sub/4"]
    assert [i.key for i in storage.list("a")] == ["a/1", "a/sub/4", "ab/3"]
    assert [(i.key, i.size) for i in storage.list("step-0000")] == [
        ("step-00000010/.metadata", len("step-00000010/.metadata"))]
    assert [i.key for i in storage.list()] == [
        "a/1", "a/sub/4", "ab/3", "b/2", "step-00000010/.metadata"]
    storage.delete("a/sub/4")
    storage.delete("a/sub/4")  # idempotent
    storage.delete("never/existed")
    assert storage.head("a/sub/4") is None
    assert [i.key for i in storage.list("a/")] == ["a/1"]


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/./b", "trailing/", "a\\b",
                                 f"x/{TMP_MARK}y"])
def test_invalid_keys_are_config_errors(storage: Storage, key: str) -> None:
    with pytest.raises(ConfigError):
        storage.put_bytes(key, b"x")
    with pytest.raises(ConfigError):
        storage.head(key)


def test_concurrent_puts(storage: Storage, tmp_path: Path) -> None:
    blobs = {f"c/{i}": os.urandom(1000 + i) for i in range(8)}
    errors: list[BaseException] = []

    def put(key: str) -> None:
        try:
            storage.put_bytes(key, blobs[key])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=put, args=(k,)) for k in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {i.key: storage.get_bytes(i.key) for i in storage.list("c/")} == blobs


def test_url_and_errors_carry_no_secrets(storage: Storage, tmp_path: Path) -> None:
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    assert secret is None or secret not in storage.url + repr(storage)
    with pytest.raises(ObjectNotFoundError) as ei:
        storage.get_bytes("missing/key")
    msg = str(ei.value)
    assert "missing/key" in msg
    if secret is not None:
        assert secret not in msg and os.environ["AWS_ENDPOINT_URL"] not in msg


def test_abort_uploads_removes_stale_upload(storage: Storage, request: pytest.FixtureRequest,
                                            tmp_path: Path) -> None:
    if isinstance(storage, MemoryStorage):
        assert storage.abort_uploads("x/") == 0  # puts are atomic: nothing can be stale
        return
    if isinstance(storage, LocalStorage):
        (storage.root / "x").mkdir()
        (storage.root / "x" / f"{TMP_MARK}dead.obj").write_bytes(b"partial")
        (storage.root / "y").mkdir()
        (storage.root / "y" / f"{TMP_MARK}dead.obj").write_bytes(b"partial")
    elif storage.url in AZURE_ENVS:  # an interrupted upload: a blob of uncommitted blocks
        aenv = AZURE_ENVS[storage.url]
        c = aenv.server.container_client()
        for k in ("x/obj", "y/obj"):
            c.get_blob_client(f"{aenv.prefix}/{k}").stage_block("YmxvY2s=", b"partial")
        assert aenv.keys(uncommitted=True) == ["x/obj", "y/obj"]
    elif storage.url.startswith("gs://"):  # temporaries are plain objects under the key
        genv = GCS_ENVS[storage.url]
        for k in ("x/obj", "y/obj"):
            genv.bucket().blob(f"{genv.prefix}/{k}{TMP_MARK}dead.00000").upload_from_string(
                b"partial")
    else:
        env = S3_ENVS[storage.url]
        c = env.client()
        for k in ("x/obj", "y/obj"):
            c.create_multipart_upload(Bucket=env.bucket, Key=f"{env.prefix}/{k}")
        assert env.pending_uploads() == ["x/obj", "y/obj"]
    assert storage.list() == []  # in-flight uploads are invisible
    assert storage.abort_uploads("x/") == 1
    assert storage.abort_uploads("x/") == 0
    assert storage.abort_uploads("y/") == 1


def test_open_storage_rejects_bad_urls(tmp_path: Path) -> None:
    for url in ["ftp://x/y", "file://host/path", "s3://key:secret@bucket/p", "s3://bucket?x=1",
                "s3:///nobucket"]:
        with pytest.raises(ConfigError):
            open_storage(url)
    with pytest.raises(ConfigError):
        open_storage("s3://bucket/p", part_size=1024)  # below S3's 5 MiB minimum part
    with pytest.raises(ConfigError):
        open_storage("s3://bucket/p", no_such_option=1)
    (tmp_path / "d").mkdir()
    assert isinstance(open_storage((tmp_path / "d").as_uri()), LocalStorage)


@pytest.mark.parametrize("offset,length", [(0, 0), (0, 1), (4095, 10), (0, 6 * MiB + 123),
                                           (MiB - 3, 5 * MiB + 7), (6 * MiB + 122, 1)])
def test_get_range_returns_exactly_those_bytes(storage: Storage, tmp_path: Path,
                                               offset: int, length: int) -> None:
    data = os.urandom(6 * MiB + 123)
    p, crc = write(tmp_path / "f", data)
    storage.put_file("obj", p, crc32c=crc, size=len(data))
    before = storage.bytes_read
    assert storage.get_range("obj", offset, length) == data[offset:offset + length]
    assert storage.bytes_read - before == length  # what a reader fetched, counted


def test_get_range_past_the_end_or_missing_is_an_error(storage: Storage) -> None:
    storage.put_bytes("small", b"0123456789")
    with pytest.raises(StorageError):
        storage.get_range("small", 5, 10)
    with pytest.raises(ObjectNotFoundError):
        storage.get_range("nope", 0, 1)
    with pytest.raises(ConfigError):
        storage.get_range("small", -1, 2)


def test_bytes_read_counts_every_get(storage: Storage, tmp_path: Path) -> None:
    p, crc = write(tmp_path / "f", b"x" * 1000)
    storage.put_file("a", p, crc32c=crc, size=1000)
    before = storage.bytes_read
    storage.get_bytes("a")
    storage.get_file("a", tmp_path / "out")
    assert storage.bytes_read - before == 2000
