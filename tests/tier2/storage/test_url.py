"""Tier-2 URLs: parse_url is the one set of rules (ManagerConfig and open_storage both use
it); a file:// tier 2 must already exist; a malformed AWS endpoint is a ConfigError."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.errors import ConfigError, StorageError
from tierckpt.tier2.storage import LocalStorage, MemoryStorage, open_storage
from tierckpt.tier2.storage.url import StorageURL, parse_url

BAD = [  # (url, what the message must say)
    ("s3://", "has no bucket"),
    ("s3:///prefix", "has no bucket"),
    ("s3://b:9000/p", "is a host:port, not a bucket name"),
    ("s3://bucket name/p", "is not a bucket name"),
    ("s3://bucket/a//b", "is not valid"),
    ("s3://bucket/p?versionId=1", "the only query a tier-2 URL takes is ?run=NAME"),
    ("s3://bucket/p?run=a&x=1", "the only query a tier-2 URL takes is ?run=NAME"),
    ("s3://bucket/p?", "the only query a tier-2 URL takes is ?run=NAME"),
    ("file:///x?run=", "must be 1-64 letters"),
    ("s3://bucket/p?run=../b", "must be 1-64 letters"),
    ("s3://bucket/p?run=a/b", "must be 1-64 letters"),
    ("s3://bucket/p#x", "must not have a fragment"),
    ("file://relative/p", "names the host 'relative'"),
    ("file:relative/p", "file:///absolute/path"),
    ("file://", "file:///absolute/path"),
    (" file:///x", "surrounding spaces"),
    ("s3://bucket/p\n", "control characters"),
    ("ftp://x/y", "unsupported URL"),
    ("gs://", "has no bucket"),
    ("gs://My_Bucket/p", "is not a bucket name"),
    ("gs://b:4443/p", "is a host:port, not a bucket name"),
    ("az:///p", "has no container"),
    ("az://ckpt_runs/p", "is not a container name"),
    ("az://a--b/p", "is not a container name"),
    ("az://ckpt/a/../b", "is not valid"),
    ("/mnt/ckpt", "unsupported URL"),
]


@pytest.mark.parametrize(("url", "fragment"), BAD)
def test_parse_url_refuses_naming_the_argument(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_url(url, name="--tier2")
    assert str(e.value).startswith("--tier2") and fragment in str(e.value), str(e.value)


@pytest.mark.parametrize(("url", "fragment"), BAD)
def test_open_storage_applies_the_same_rules(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as opened:
        open_storage(url)
    with pytest.raises(ConfigError) as parsed:
        parse_url(url)
    assert str(opened.value) == str(parsed.value)


def test_credentials_in_an_s3_url_are_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as e:
        parse_url("s3://key:s3cr3t@bucket/p", name="tier2")
    assert "s3cr3t" not in str(e.value) and "AWS_ENDPOINT_URL" in str(e.value)
    for url, where in (("gs://key:s3cr3t@bucket/p", "STORAGE_EMULATOR_HOST"),
                       ("az://acct:s3cr3t@ckpt/p", "AZURE_STORAGE_CONNECTION_STRING")):
        with pytest.raises(ConfigError) as e:
            parse_url(url, name="tier2")
        assert "s3cr3t" not in str(e.value) and where in str(e.value), str(e.value)


def test_parse_url_values() -> None:
    assert parse_url("s3://bucket/a/b/") == StorageURL(scheme="s3", location="bucket",
                                                       prefix="a/b")
    assert parse_url("s3://my.bucket-1") == StorageURL(scheme="s3", location="my.bucket-1")
    assert parse_url("file:///mnt/my%20ckpt") == StorageURL(scheme="file",
                                                            location="/mnt/my ckpt")
    assert parse_url("file://localhost/mnt/x").location == "/mnt/x"
    assert parse_url("memory://t") == StorageURL(scheme="memory", location="t")
    assert parse_url("gs://my-bucket.x/run/1") == StorageURL(scheme="gs", location="my-bucket.x",
                                                             prefix="run/1")
    assert parse_url("az://ckpt-runs/") == StorageURL(scheme="az", location="ckpt-runs")
    assert parse_url("memory://").location == "mem"
    assert parse_url("s3://bucket/ft/?run=lora-a") == StorageURL(
        scheme="s3", location="bucket", prefix="ft", run="lora-a")
    assert parse_url("file:///mnt/t2?run=b.2").run == "b.2"
    with pytest.raises(ConfigError, match="must be a URL string"):
        parse_url(None)


def test_a_missing_file_tier2_is_refused_never_created(tmp_path: Path) -> None:
    missing = tmp_path / "mnt" / "nfs" / "ckpt"  # e.g. an NFS export that is not mounted
    for open_it in (lambda: open_storage(missing.as_uri()), lambda: LocalStorage(missing)):
        with pytest.raises(ConfigError, match=r"does not exist; create it .* or mount"):
            open_it()
    assert not (tmp_path / "mnt").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        open_storage((tmp_path / "file").as_uri())
    missing.mkdir(parents=True)
    with open_storage(missing.as_uri()) as st:
        assert isinstance(st, LocalStorage) and st.root == missing


def test_a_file_tier2_that_vanishes_is_not_recreated_by_a_put(tmp_path: Path) -> None:
    root = tmp_path / "t2"
    root.mkdir()
    st = LocalStorage(root)
    st.put_bytes("step-00000001/a", b"x")
    (root / "step-00000001" / "a").unlink()
    (root / "step-00000001").rmdir()
    root.rmdir()  # the file system was unmounted under the job
    with pytest.raises(StorageError, match="no longer exists"):
        st.put_bytes("step-00000002/a", b"y")
    assert not root.exists()


def test_memory_urls_open_a_memory_store_and_refuse_store_options() -> None:
    assert isinstance(open_storage("memory://x"), MemoryStorage)
    with pytest.raises(ConfigError, match=r"object-store options .* memory://"):
        open_storage("memory://x", part_size=1)


# -- the S3 endpoint from the environment -------------------------------------------------------
@pytest.fixture
def no_endpoint(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")  # no endpoint from a config file
    return monkeypatch


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
@pytest.mark.parametrize("value", ["localhost:9000", "ftp://localhost:9000",
                                   "http://localhost:port", "http://"])
def test_a_malformed_endpoint_is_a_config_error_naming_the_variable(
        no_endpoint: pytest.MonkeyPatch, var: str, value: str) -> None:
    no_endpoint.setenv(var, value)
    from tierckpt.tier2.storage.s3 import S3Storage

    for make in (lambda: open_storage("s3://bucket/p"), lambda: S3Storage("bucket", "p")):
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value).startswith(f"{var}=") and "http://host:port" in str(e.value)
    if "://" not in value:
        assert f"http://{value}" in str(e.value)  # the fix, spelled out


def test_a_good_or_ignored_endpoint_opens(no_endpoint: pytest.MonkeyPatch) -> None:
    no_endpoint.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # no request is made
    with open_storage("s3://bucket/p") as st:
        assert st.url == "s3://bucket/p"
    no_endpoint.setenv("AWS_ENDPOINT_URL", "localhost:9000")
    no_endpoint.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")  # botocore ignores it
    open_storage("s3://bucket/p").close()
