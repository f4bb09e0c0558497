"""The clients ``bench/tier2_servers.py`` times on each store, each moving one file up and
down with the same part size and concurrency where it has such settings:

- :class:`Ours`: tierckpt's backend (``S3Storage``/``GCSStorage``/``AzureStorage``)
  ``put_file``/``get_file``, verified end to end in the mode the probe picked (declared
  checksums, CRC32C of every byte fetched, fsync'd and renamed into place);
- :func:`boto3_client`, :func:`gcs_sdk_client`, :func:`azure_sdk_client`: the store's own
  SDK doing the same transfer without any of that (no checksum asked for or checked, no
  fsync);
- :class:`Obstore`: obstore (one Rust client over the ``object_store`` crate for all three
  stores): ``obstore.put`` of the file (multipart above the part size), and parallel ranged
  GETs written into the file. Nothing verified either.

Each client is given ``(key, path)`` and says nothing: the bench times the calls. Keys are
full object names in the store's bucket (container).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
PART = 16 * MiB
"""Part (block, chunk, range) size of every client that has one."""
CONCURRENCY = 8
"""Parallel parts (ranges) of every client that has such a setting."""

Transfer = Callable[[str, Path], None]
"""``(object name, local file)``: upload the file to the name, or download it into the file."""


@dataclass(frozen=True)
class Client:
    """One client on one store: how it uploads and downloads, and what that is, for the
    table. ``upload`` None: it cannot write to this store (``no_upload`` says why); its
    download then reads ``read_from``'s object."""

    name: str
    what: str
    upload: Transfer | None
    download: Transfer
    close: Callable[[], None] = lambda: None
    no_upload: str = ""
    read_from: str = ""


# ----------------------------------------------------------------------------- tierckpt


def ours(storage: Any, prefix: str, crc32c: int, size: int) -> Client:
    """tierckpt's backend over ``<bucket>/<prefix>``; the file's CRC32C and size come from
    the manifest in a real upload, so they are given here too (not timed)."""
    cut = len(prefix) + 1

    def up(key: str, src: Path) -> None:
        storage.put_file(key[cut:], src, crc32c=crc32c, size=size)

    def down(key: str, dst: Path) -> None:
        storage.get_file(key[cut:], dst, crc32c=crc32c)

    return Client(f"tierckpt {type(storage).__name__}",
                  "put_file / get_file, verified end to end", up, down, storage.close)


# ----------------------------------------------------------------------------- SDKs


def boto3_transfer(endpoint: str | None) -> tuple[Any, Any]:
    """A boto3 S3 client (no checksums asked for or checked) and a ``TransferConfig`` of
    :data:`PART` and :data:`CONCURRENCY` (bench.share and bench.tier0 use these too)."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required", max_pool_connections=16))
    return client, TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                  max_concurrency=CONCURRENCY)


def boto3_client(endpoint: str, bucket: str) -> Client:
    client, tcfg = boto3_transfer(endpoint)
    return Client("boto3", "upload_file / download_file",
                  lambda key, src: client.upload_file(str(src), bucket, key, Config=tcfg),
                  lambda key, dst: client.download_file(bucket, key, str(dst), Config=tcfg),
                  client.close)


def gcs_sdk_client(endpoint: str, bucket: str) -> Client:
    """google-cloud-storage, anonymous against the emulator. The upload is one resumable
    upload in :data:`PART` chunks, one after another (``upload_from_filename`` has no
    concurrency); the download one streamed GET (a ``chunk_size`` would make it sequential
    ranged GETs)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": endpoint})
    b = client.bucket(bucket)
    return Client(
        "google-cloud-storage", "blob.upload_from_filename / download_to_filename",
        lambda key, src: b.blob(key, chunk_size=PART).upload_from_filename(
            str(src), checksum=None),
        lambda key, dst: b.blob(key).download_to_filename(str(dst), checksum=None),
        client.close)


def azure_sdk_client(connection_string: str, container: str) -> Client:
    """azure-storage-blob: ``upload_blob`` in :data:`PART` blocks and ``download_blob`` in
    :data:`PART` ranges, :data:`CONCURRENCY` at a time; no Content-MD5."""
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(
        connection_string, max_block_size=PART, max_single_put_size=PART,
        max_single_get_size=PART, max_chunk_get_size=PART)
    c = service.get_container_client(container)

    def up(key: str, src: Path) -> None:
        with open(src, "rb") as f:
            c.upload_blob(key, f, length=src.stat().st_size, overwrite=True,
                          max_concurrency=CONCURRENCY)

    def down(key: str, dst: Path) -> None:
        with open(dst, "wb") as f:
            c.download_blob(key, max_concurrency=CONCURRENCY).readinto(f)

    return Client("azure-storage-blob", "upload_blob / download_blob(max_concurrency)", up,
                  down, service.close)


# ----------------------------------------------------------------------------- obstore


OBSTORE_WHAT = "obstore.put / parallel get_range_async"


def obstore_missing() -> str | None:
    """Why obstore cannot be measured (not installed), or None."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return "obstore is not installed (pip install obstore==0.12.1; pinned in [dev])"
    return None


def obstore_client(store: Any, *, no_upload: str = "", read_from: str = "") -> Client:
    """obstore over ``store`` (an ``obstore.store`` S3Store, GCSStore or AzureStore)."""
    import obstore

    def up(key: str, src: Path) -> None:
        obstore.put(store, key, src, chunk_size=PART, max_concurrency=CONCURRENCY)

    async def ranges(key: str, dst: Path) -> None:
        size = (await obstore.head_async(store, key))["size"]
        gate = asyncio.Semaphore(CONCURRENCY)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)

        async def one(off: int) -> None:
            async with gate:
                data = await obstore.get_range_async(store, key, start=off,
                                                     length=min(PART, size - off))
                os.pwrite(fd, data, off)

        try:
            await asyncio.gather(*(one(off) for off in range(0, size, PART)))
        finally:
            os.close(fd)

    return Client("obstore", OBSTORE_WHAT, None if no_upload else up,
                  lambda key, dst: asyncio.run(ranges(key, dst)),
                  no_upload=no_upload, read_from=read_from)


def obstore_s3(endpoint: str, bucket: str, env: dict[str, str]) -> Client:
    from obstore.store import S3Store

    return obstore_client(S3Store(
        bucket, endpoint=endpoint, access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region=env["AWS_DEFAULT_REGION"],
        client_options={"allow_http": True}))


OBSTORE_GCS_NO_UPLOAD = (
    "fake-gcs-server 1.54 cannot take obstore's writes: object_store's GCSStore writes only "
    "through GCS's XML API (PUT /bucket/object; POST ?uploads for multipart), which the "
    "emulator routes to its JSON upload handler and answers 400 'invalid uploadType'; its "
    "download is measured on the google-cloud-storage client's object")


def obstore_gcs(endpoint: str, bucket: str, read_from: str) -> Client:
    """obstore against fake-gcs-server: no OAuth through a service-account key whose
    ``disable_oauth`` is set (object_store's emulator route; ``skip_signature`` alone still
    asked the metadata server for a token), ``gcs_base_url`` the emulator, plain HTTP. The
    emulator must have been started with ``path_style_reads``."""
    from obstore.store import GCSStore

    key = json.dumps({"gcs_base_url": endpoint, "disable_oauth": True, "client_email": "",
                      "private_key": "", "private_key_id": ""})
    return obstore_client(GCSStore(bucket, service_account_key=key,
                                   client_options={"allow_http": True}),
                          no_upload=OBSTORE_GCS_NO_UPLOAD, read_from=read_from)


def obstore_azure(blob_endpoint: str, container: str, account: str, key: str) -> Client:
    """obstore against Azurite: the account's blob URL (``http://host:port/<account>``)
    as ``endpoint`` (path-style, as Azurite serves), shared key, plain HTTP."""
    from obstore.store import AzureStore

    return obstore_client(AzureStore(container, account_name=account, account_key=key,
                                     endpoint=blob_endpoint,
                                     client_options={"allow_http": True}))
