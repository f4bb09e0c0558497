"""The probe on Google Cloud Storage (fake-gcs-server) and Azure Blob Storage (Azurite), as on
S3: the modes it chooses reach the uploader as that store's options, and its cache on tier 1
is keyed by the server (endpoint or account, and bucket or container), never by the URL
alone. Pure cases first (the server's identity from the environment), then the emulators."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from azureserver import AZURE_VARS, AzureEnv
from gcsserver import GCSEnv

from tests._synthetic import make_checkpoint
from tierckpt.errors import ConfigError
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2 import probe
from tierckpt.tier2.capabilities import IntegrityMode, MarkerMode
from tierckpt.tier2.uploader import Uploader, UploaderConfig

SMALL = {".metadata": (300, None), "__0_0.distcp": (5000, 0)}
KEY = "c2VjcmV0LWtleQ=="  # an account key: it must never be part of an identity


def test_a_gcs_identity_is_the_endpoint_and_the_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    assert probe.server_identity("gs://b-1/run") == "https://storage.googleapis.com|b-1"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    assert probe.server_identity("gs://b-1/run") == "http://127.0.0.1:4443|b-1"
    assert probe.server_identity("gs://b-2/other") == "http://127.0.0.1:4443|b-2"


@pytest.mark.parametrize(("env", "endpoint"), [
    ({}, "azure"),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "acct1", "AZURE_STORAGE_KEY": KEY},
     "https://acct1.blob.core.windows.net"),
    ({"AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName=dev;"
      f"AccountKey={KEY};BlobEndpoint=http://127.0.0.1:10000/dev/;"},
     "http://127.0.0.1:10000/dev"),
    ({"AZURE_STORAGE_CONNECTION_STRING": f"AccountName=acct2;AccountKey={KEY};"
      "EndpointSuffix=core.chinacloudapi.cn"}, "https://acct2.blob.core.chinacloudapi.cn"),
    ({"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"},
     "http://127.0.0.1:10000/devstoreaccount1"),
], ids=["none", "account-name", "blob-endpoint", "endpoint-suffix", "development"])
def test_an_azure_identity_is_the_account_endpoint_and_the_container(
        env: dict[str, str], endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in AZURE_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    identity = probe.server_identity("az://box/run")
    assert identity == f"{endpoint}|box" and KEY not in identity


def test_gcs_probe_gives_the_uploader_its_integrity_and_is_cached_per_server(
        tmp_path: Path, gcs_env: GCSEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    local = Tier1Catalog(tmp_path)
    r = probe.probe_cached(local, gcs_env.url)
    # fake-gcs-server stores bytes whatever CRC32C they declare: md5 (see tests/gcsserver.py)
    assert r.modes.integrity is IntegrityMode.MD5 and r.modes.marker is MarkerMode.CREATE_ONLY
    assert r.store_options() == {"integrity": "md5"}  # GCSConfig takes no marker or upload
    assert r.capabilities.server == f"{gcs_env.server.endpoint}|{gcs_env.server.bucket}"
    assert probe.cached(local, gcs_env.url) == r
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # another server
    assert probe.cached(local, gcs_env.url) is None
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")  # GCS itself
    assert probe.cached(local, gcs_env.url) is None


def test_azure_probe_is_cached_per_account(tmp_path: Path, azure_env: AzureEnv,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    local = Tier1Catalog(tmp_path)
    r = probe.probe_cached(local, azure_env.url)
    assert r.modes.integrity is IntegrityMode.MD5 and r.modes.marker is MarkerMode.CREATE_ONLY
    assert r.store_options() == {}  # AzureConfig has no modes: Content-MD5 and If-None-Match
    server = azure_env.server
    assert r.capabilities.server == f"{server.endpoint}/devstoreaccount1|{server.container}"
    assert probe.cached(local, azure_env.url) == r
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       server.env("http://127.0.0.1:9")["AZURE_STORAGE_CONNECTION_STRING"])
    assert probe.cached(local, azure_env.url) is None


def test_a_gcs_uploader_uploads_in_the_mode_the_probe_chose(tmp_path: Path,
                                                            gcs_env: GCSEnv) -> None:
    make_checkpoint(tmp_path, 3, SMALL)
    with Uploader(UploaderConfig(tier1=tmp_path, tier2=gcs_env.url)) as up:
        assert up.storage.integrity == "md5"  # not GCSConfig's default, crc32c
        r = up.run_once()
    assert r is not None and r.status == "verified", r
    record = Tier1Catalog(tmp_path).uploads.upload_record(3)
    assert record is not None and record["integrity"] == "md5"
    recorded = probe.recorded(Tier1Catalog(tmp_path))  # probed once, for the next reader
    assert recorded is not None and recorded.url == gcs_env.url
    # a caller that names the integrity mode gets it, unprobed
    opts = {"integrity": "crc32c"}
    with Uploader(UploaderConfig(tier1=tmp_path, tier2=gcs_env.url,
                                 storage_options=opts)) as up:
        assert up.storage.integrity == "crc32c"


def test_an_azure_uploader_checks_the_probe_and_verifies(tmp_path: Path,
                                                        azure_env: AzureEnv) -> None:
    make_checkpoint(tmp_path, 5, SMALL)
    with Uploader(UploaderConfig(tier1=tmp_path, tier2=azure_env.url)) as up:
        r = up.run_once()
    assert r is not None and r.status == "verified", r
    record = Tier1Catalog(tmp_path).uploads.upload_record(5)
    assert record is not None and record["integrity"] == "md5"
    assert probe.cached(Tier1Catalog(tmp_path), azure_env.url) is not None
    assert "step-00000005/COMPLETE" in azure_env.keys()  # noqa: SIM118 (a method: a list)


def test_s3_options_is_the_old_name_of_storage_options(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = UploaderConfig(tier1=tmp_path, tier2="s3://b/p", s3_options={"part_size": 1})
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "storage_options" in str(caught[0].message)
    assert c.storage_options == {"part_size": 1} and c.s3_options is None
    with pytest.raises(ConfigError, match="storage_options only"):
        UploaderConfig(tier1=tmp_path, tier2="s3://b/p", s3_options={"part_size": 1},
                       storage_options={"part_size": 2})
