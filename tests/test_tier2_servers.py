"""The same run on both real S3 servers (SeaweedFS: crc32c mode; moto: md5 mode): train and
save with tier 2, wipe tier 1, resume from tier 2 alone — bit-identical losses; and what
the weaker mode catches on a server that verifies nothing (moto behind the fault proxy)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3server import S3Env, _env_for

from tests._tinyjob import resume_from_tier2_alone
from tierckpt.errors import BadDigestError, StorageError
from tierckpt.format import checksum
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

MiB = 1024 * 1024


@pytest.mark.slow
def test_resume_from_tier2_only_on_each_server(tmp_path: Path, any_s3_env: S3Env) -> None:
    """The whole round trip through the job: probe, uploader process in the server's mode,
    drain on close, fetch from tier 2 verified against the manifest."""
    root = tmp_path / "t1"
    mode = {"seaweedfs": "crc32c", "moto": "md5"}[any_s3_env.server.kind]

    def uploaded() -> None:
        assert Tier1Catalog(root).uploads.upload_record(5)["integrity"] == mode  # type: ignore[index]

    resume_from_tier2_alone(root, any_s3_env.url, saved=5, end=12, width=512, batch=32,
                            uploaded=uploaded)


@pytest.fixture
def moto_proxy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[S3Env, Any]]:
    """moto's server (it checks neither CRC32C nor Content-MD5) behind the fault proxy."""
    from faultproxy import FaultProxy

    env = _env_for(request.getfixturevalue("moto_server"), monkeypatch)
    host, port = env.server.endpoint.removeprefix("http://").rsplit(":", 1)
    with FaultProxy(host, int(port)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield env, proxy


def test_a_server_that_checks_nothing_is_caught_before_the_marker(
        tmp_path: Path, moto_proxy: tuple[S3Env, Any]) -> None:
    from faultproxy import GET, PUT_OBJECT, UPLOAD_PART

    env, proxy = moto_proxy
    src = tmp_path / "src"
    data = bytes(range(256)) * 4096  # 1 MiB
    src.write_bytes(data)
    crc = checksum.extend(0, data)
    opts = {"integrity": "md5", "digest_attempts": 2, "part_size": 5 * MiB,
            "multipart_threshold": 5 * MiB}
    with open_storage(env.url, **opts) as st:
        proxy.add_rule("corrupt", times=None, **PUT_OBJECT)  # every upload flipped in transit
        with pytest.raises(BadDigestError, match="ETag is not their MD5"):
            st.put_file("step-00000001/__0_0.distcp", src, crc32c=crc, size=len(data))
        proxy.clear()
        big = tmp_path / "big"
        big.write_bytes(data * 6)  # 6 MiB: two parts
        proxy.add_rule("corrupt", times=None, **UPLOAD_PART)
        with pytest.raises(BadDigestError, match="part"):
            st.put_file("step-00000001/big", big, crc32c=checksum.of_file(big)[0],
                        size=6 * MiB)
        proxy.clear()
        st.put_file("step-00000001/__0_0.distcp", src, crc32c=crc, size=len(data))
        proxy.add_rule("corrupt_response", times=None, **GET)  # flipped on the way back
        with pytest.raises(BadDigestError):
            st.get_file("step-00000001/__0_0.distcp", tmp_path / "dl", crc32c=crc)
        assert not (tmp_path / "dl").exists()
        proxy.clear()
        assert Tier2Catalog(st).complete_steps() == []  # no marker anywhere
    with open_storage(env.url, integrity="crc32c") as st, \
            pytest.raises(StorageError, match="reports no full-object CRC32C"):
        st.put_file("k", src, crc32c=crc, size=len(data))  # crc32c mode is loud here
