"""The same run on both real S3 servers (SeaweedFS: crc32c mode; moto: md5 mode): train and
save with tier 2, wipe tier 1, resume from tier 2 alone — bit-identical losses; and what
the weaker mode catches on a server that verifies nothing (moto behind the fault proxy)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from s3server import S3Env, _env_for
from torch import nn

import tierckpt
from tierckpt.errors import BadDigestError, StorageError
from tierckpt.format import checksum, layout
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage

MiB = 1024 * 1024


def _state(seed: int = 0) -> tierckpt.TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.Dropout(0.1), nn.Linear(512, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierckpt.TrainState(model=model, optimizer=opt, extra={"seen": 0})


def _train(st: tierckpt.TrainState, steps: range) -> list[float]:
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 512, generator=g)
        loss = st.model(x).pow(2).mean()
        st.optimizer.zero_grad()
        loss.backward()
        st.optimizer.step()
        st.extra["seen"] += 32
        out.append(loss.item())
    return out


@pytest.mark.slow
def test_resume_from_tier2_only_on_each_server(tmp_path: Path, any_s3_env: S3Env) -> None:
    """The whole round trip through the job: probe, uploader process in the server's mode,
    drain on close, fetch from tier 2 verified against the manifest."""
    root = tmp_path / "t1"
    ref_state = _state()
    reference = _train(ref_state, range(0, 12))
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, tier2=any_s3_env.url, keep_last=2) as ck:
        losses = _train(st, range(0, 6))
        ck.save(5, st).wait()  # close() drains the upload
    assert losses == reference[:6]
    mode = {"seaweedfs": "crc32c", "moto": "md5"}[any_s3_env.server.kind]
    assert Tier1Catalog(root).uploads.upload_record(5)["integrity"] == mode  # type: ignore[index]
    shutil.rmtree(root)  # the node is gone: tier 2 alone
    st2 = _state(seed=99)
    with tierckpt.CheckpointManager(tier1=root, tier2=any_s3_env.url) as ck:
        info = ck.restore(st2)
        assert info is not None and info.step == 5 and info.source == "tier2"
        assert _train(st2, range(6, 12)) == reference[6:]  # bit-identical
    assert any(e["event"] == events.RESTORE_DONE for e in events.read_events(root / layout.EVENTS))


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
