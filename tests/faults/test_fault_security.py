"""Hardened loading: nothing pickled is opened before it is verified, signing refuses loudly,
manifest names cannot escape the checkpoint, and cleanup never follows a symlink.

Decision on signing (documented in docs/faults.md): with ``TIERCKPT_SIGNING_KEY`` set, an
unsigned or badly signed candidate makes ``restore()`` raise :class:`SignatureError` on every
rank; nothing is moved aside and no older checkpoint is tried (a wrong key would otherwise
quarantine every checkpoint and training would silently start from scratch).
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
from pathlib import Path

import pytest

import tierckpt
from tests.faults._oracle import (
    TALLY,
    check_root,
    make_state,
    restore_step,
    save_steps,
    snapshot,
)
from tierckpt.errors import SignatureError
from tierckpt.format import layout
from tierckpt.format import manifest as mf

KEY_ENV = mf.SIGNING_KEY_ENV


class _Trap:
    """Unpickling this creates ``path`` (no os.system: ``Path.touch`` via ``__reduce__``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (pathlib.Path.touch, (pathlib.PosixPath(self.path),))


def _trap_bytes(fired: Path, size: int | None = None) -> bytes:
    data = pickle.dumps(_Trap(fired))
    if size is not None:  # pad to the original size: pickle ignores bytes after STOP
        assert len(data) <= size
        data += b" " * (size - len(data))
    return data


def test_trap_is_armed(tmp_path: Path) -> None:
    fired = tmp_path / "fired"
    pickle.loads(_trap_bytes(fired, 4096))
    assert fired.exists()  # so the tests below would notice an unpickle


def _rewrite_manifest(d: Path, edit: object, *, key: bytes | None = None) -> None:
    """Edit manifest.json (``edit(dict)``) and re-make COMPLETE so the digest matches, as a
    hand (or an attacker without the key) would."""
    body = json.loads((d / layout.MANIFEST).read_bytes())
    edit(body)  # type: ignore[operator]
    mbytes = json.dumps(body, sort_keys=True, indent=1).encode() + b"\n"
    (d / layout.MANIFEST).write_bytes(mbytes)
    (d / layout.COMPLETE).unlink()
    (d / layout.COMPLETE).write_bytes(mf.marker_bytes(mbytes, body["step"], body["save_id"],
                                                      key))


@pytest.mark.parametrize("case", ["unverified", "same-size-sizes-mode", "resigned-manifest"])
def test_malicious_metadata_is_never_unpickled(tmp_path: Path, case: str) -> None:
    """The trap replaces both metadata files a restore may plan from: the rank's own
    ``__0.metadata`` (the saved layout) and ``.metadata`` (its fallback)."""
    root, fired = tmp_path / "tier1", tmp_path / "FIRED"
    save_steps(root, [1, 2])
    d = root / "step-00000002"
    members = (layout.METADATA, layout.rank_metadata_filename(0))
    if case == "unverified":  # no COMPLETE: the directory never committed
        (d / layout.COMPLETE).unlink()
        for name in members:
            (d / name).write_bytes(_trap_bytes(fired))
    elif case == "same-size-sizes-mode":  # sizes match; only the CRC32C can tell
        for name in members:
            (d / name).write_bytes(_trap_bytes(fired, (d / name).stat().st_size))
    else:
        # The manifest is rewritten to vouch for the trap's size (no signing key). Its
        # CRC32C is left alone, so the CRC check before any unpickling catches it (a forger
        # who also fixes the CRC is only stopped by signing: see the next test).
        trap = _trap_bytes(fired)
        for name in members:
            (d / name).write_bytes(trap)

        def edit(body: dict) -> None:
            for f in body["files"]:
                if f["name"] in members:
                    f["size"] = len(trap)
                    f.pop("chunks", None)
        _rewrite_manifest(d, edit)
    st = make_state(-1)
    with tierckpt.CheckpointManager(tier1=root, verify="sizes") as ck:
        info = ck.restore(st)
    TALLY.add("malicious .metadata pickle", lost=0)
    assert not fired.exists(), "an unverified pickle was opened"
    assert info is not None and info.step == 1
    (q,) = (root / layout.QUARANTINE).iterdir()
    reason = (q / "QUARANTINE_REASON").read_text()
    assert ("COMPLETE" in reason) if case == "unverified" else ("CRC32C" in reason)


def test_forged_checkpoint_refused_when_signing(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With a key, a forgery that rewrites manifest, CRC and COMPLETE (everything but the
    HMAC) is refused loudly, and its pickle is never opened."""
    monkeypatch.setenv(KEY_ENV, "k1")
    root, fired = tmp_path / "tier1", tmp_path / "FIRED"
    save_steps(root, [1, 2])
    d = root / "step-00000002"
    trap = _trap_bytes(fired)
    (d / layout.METADATA).write_bytes(trap)

    def edit(body: dict) -> None:
        from tierckpt.format import checksum
        for f in body["files"]:
            if f["name"] == layout.METADATA:
                f["size"], f["crc32c"] = len(trap), checksum.to_hex(checksum.extend(0, trap))
    _rewrite_manifest(d, edit, key=None)
    with tierckpt.CheckpointManager(tier1=root) as ck, \
            pytest.raises(SignatureError, match=r"refusing to restore .*unsigned"):
        ck.restore(make_state(-1))
    TALLY.add("forged checkpoint (signing on)")
    assert not fired.exists()
    assert (d / layout.COMPLETE).exists() and not (root / layout.QUARANTINE).exists()


def test_signing_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "tier1"
    monkeypatch.setenv(KEY_ENV, "right-key")
    save_steps(root, [1, 2])
    marker = json.loads((root / "step-00000002" / layout.COMPLETE).read_bytes())
    assert len(marker["manifest_hmac_sha256"]) == 64
    assert restore_step(root) == (2, 2.0)
    before = snapshot(root)

    monkeypatch.setenv(KEY_ENV, "wrong-key")
    with tierckpt.CheckpointManager(tier1=root) as ck, \
            pytest.raises(SignatureError, match=r"does not verify.*TIERCKPT_SIGNING_KEY"):
        ck.restore(make_state(-1))
    TALLY.add("wrong signing key")
    assert not (root / layout.QUARANTINE).exists()
    monkeypatch.setenv(KEY_ENV, "right-key")
    assert check_root(root, before) == []  # nothing moved or changed by the refusal

    monkeypatch.delenv(KEY_ENV)  # without a key, signed checkpoints still load
    assert restore_step(root) == (2, 2.0)


def test_unsigned_checkpoint_refused_when_key_set(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "tier1"
    monkeypatch.delenv(KEY_ENV, raising=False)
    save_steps(root, [1])
    monkeypatch.setenv(KEY_ENV, "k")
    save_steps(root, [2])  # a signed newer one does not hide the unsigned older one ...
    assert restore_step(root) == (2, 2.0)  # ... it is simply preferred
    (root / "step-00000002" / layout.COMPLETE).unlink()  # now the unsigned one is next
    with tierckpt.CheckpointManager(tier1=root) as ck, \
            pytest.raises(SignatureError, match="unsigned"):
        ck.restore(make_state(-1))
    TALLY.add("unsigned checkpoint (signing on)")
    assert (root / "step-00000001" / layout.COMPLETE).exists()


@pytest.mark.parametrize("bad_name", ["../escape.distcp", "/etc/passwd", "sub/x.distcp", ".."])
def test_manifest_names_cannot_escape_the_checkpoint(tmp_path: Path, bad_name: str) -> None:
    root = tmp_path / "tier1"
    save_steps(root, [1, 2])
    d = root / "step-00000002"
    outside = tmp_path / "escape.distcp"
    outside.write_bytes(b"x" * 10)

    def edit(body: dict) -> None:
        body["files"].append({"name": bad_name, "size": 10, "crc32c": "00000000", "rank": 0})
    _rewrite_manifest(d, edit)
    assert restore_step(root) == (1, 1.0)
    TALLY.add("manifest name escaping the root")
    (q,) = (root / layout.QUARANTINE).iterdir()
    assert "unsafe checkpoint member name" in (q / "QUARANTINE_REASON").read_text()
    assert outside.read_bytes() == b"x" * 10


def test_manifest_member_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "tier1"
    save_steps(root, [1, 2])
    d = root / "step-00000002"
    shard = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    elsewhere = tmp_path / "elsewhere.distcp"
    os.rename(shard, elsewhere)  # same bytes, same size, but reached through a link
    os.symlink(elsewhere, shard)
    assert restore_step(root) == (1, 1.0)
    TALLY.add("manifest member is a symlink")
    (q,) = (root / layout.QUARANTINE).iterdir()
    assert "not a regular file" in (q / "QUARANTINE_REASON").read_text()
    assert elsewhere.exists()


@pytest.mark.parametrize("kind", ["tmp", "del"])
def test_cleanup_never_follows_symlinks(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "tier1"
    save_steps(root, [1])
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.bin").write_bytes(b"keep me")
    name = (layout.tmp_dirname(2, "crashed") if kind == "tmp"
            else layout.deleting_dirname(0, "crashed"))
    stale = root / name
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    os.symlink(precious / "data.bin", stale / "link-to-file")
    os.symlink(precious, stale / "link-to-dir")
    linked_stale = root / layout.tmp_dirname(3, "linked")  # a stale name that IS a link
    os.symlink(precious, linked_stale)
    with tierckpt.CheckpointManager(tier1=root):
        pass
    TALLY.add("symlinks in stale tmp/del dirs")
    assert not stale.exists()
    assert (precious / "data.bin").read_bytes() == b"keep me"
    assert sorted(os.listdir(precious)) == ["data.bin"]
    assert restore_step(root) == (1, 1.0)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_verified_but_poisoned_rank_state_loads_weights_only(tmp_path: Path) -> None:
    """A forger without a signing key can commit a checkpoint whose every checksum is right
    (F31). The per-rank state blob inside it is a pickle; it loads with
    ``weights_only=True``, so the trap in it is refused with a loud error, never run."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierckpt.errors import CheckpointError
    from tierckpt.save import writer
    from tierckpt.tier1 import commit

    root, fired = tmp_path / "tier1", tmp_path / "FIRED"
    save_steps(root, [1])
    st = make_state(2)
    sd = st.state_dict()
    (rank,) = sd["rank_state"]
    sd["rank_state"][rank] = torch.frombuffer(bytearray(_trap_bytes(fired)), dtype=torch.uint8)
    tmp = root / layout.tmp_dirname(2, "forged")
    tmp.mkdir()
    w = writer.ShardWriter(tmp)
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.metadata_entry is not None
    m = mf.Manifest(step=2, world_size=1, save_id="forged", files=(*w.files, w.metadata_entry),
                    domains=((0,),))
    mbytes = m.to_bytes()
    commit.commit_domain(tmp, root / layout.step_dirname(2), manifest_bytes=mbytes,
                         marker_bytes=mf.marker_bytes(mbytes, 2, "forged"), metadata_bytes=None)
    with tierckpt.CheckpointManager(tier1=root, verify="full") as ck, \
            pytest.raises(CheckpointError, match="weights_only"):
        ck.restore(make_state(-1))
    TALLY.add("verified checkpoint with a poisoned rank-state pickle")
    assert not fired.exists()
