"""S3 upload mode ``single-put`` (s3writes.py), for a server that answers 501 NotImplemented
to multipart calls (SeaweedFS behind the fault proxy): objects above the multipart
threshold go in one PUT, the stale-upload sweep asks nothing, and an object over S3's
5 GiB single-PUT limit is a clear error before a byte is sent."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from faultproxy import NO_MULTIPART
from s3server import S3Env

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import SINGLE_PUT_LIMIT
from tierckpt.tier2.storage import open_storage
from tierckpt.tier2.storage.s3 import S3Storage

MiB = 1024 * 1024


@pytest.fixture
def single(s3_env: S3Env, fault_proxy: Any) -> Any:
    fault_proxy.not_implemented(NO_MULTIPART)
    st = open_storage(s3_env.url, upload="single-put", multipart_threshold=5 * MiB)
    assert isinstance(st, S3Storage)
    with st:
        yield st


def test_a_large_object_goes_in_one_put(single: S3Storage, s3_env: S3Env, fault_proxy: Any,
                                        tmp_path: Path) -> None:
    data = os.urandom(12 * MiB)  # above the threshold: multipart mode would use 3 parts
    src = tmp_path / "shard"
    src.write_bytes(data)
    crc = checksum.extend(0, data)
    info = single.put_file("step-1/shard", src, crc32c=crc, size=len(data))
    assert (info.size, info.crc32c) == (len(data), crc)
    assert single.abort_uploads("step-1/") == 0  # nothing to sweep, nothing asked
    assert [(h.method, h.action) for h in fault_proxy.hits if h.method != "HEAD"] == [
        ("PUT", "pass")]
    c = s3_env.client()
    assert c.get_object(Bucket=s3_env.bucket,
                        Key=f"{s3_env.prefix}/step-1/shard")["Body"].read() == data


def test_over_the_single_put_limit_is_a_clear_error(single: S3Storage, s3_env: S3Env,
                                                    fault_proxy: Any, tmp_path: Path) -> None:
    big = tmp_path / "big"
    with open(big, "wb") as f:  # sparse: no disk, no bytes read before the refusal
        f.truncate(SINGLE_PUT_LIMIT + 1)
    with pytest.raises(StorageError, match=r"over S3's 5 GiB limit of one PUT.*single-put"):
        single.put_file("step-1/big", big, crc32c=0, size=SINGLE_PUT_LIMIT + 1)
    assert fault_proxy.hits == [] and s3_env.keys() == []
