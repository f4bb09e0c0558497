"""``restore/verify.py`` on the saved layout: a domain's owner verifies from the marker and
the manifest parts of its ranks, not the whole manifest; anything unexpected there (another
world size, a part that fails its check, a checkpoint from before the parts) takes the
whole manifest, which reports what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from bench.reads import Reads
from tierckpt.errors import IntegrityError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.restore.verify import verify_checkpoint


def _saved(root: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(5, tierckpt.TrainState(model=model)).wait(60)
    return root / layout.step_dirname(5)


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_owner_verifies_from_the_parts_of_its_ranks(tmp_path: Path) -> None:
    d = _saved(tmp_path / "t1")
    whole = mf.Manifest.from_bytes((d / layout.MANIFEST).read_bytes())
    with Reads(d) as reads:
        m = verify_checkpoint(d, step=5, domain=(0,), world_size=1, full=True)
    opened = {n for n, _ in reads.files}
    assert layout.part_filename(0) in opened and layout.MANIFEST not in opened, opened
    assert (m.step, m.save_id, m.world_size, m.domains) == (5, whole.save_id, 1, ((0,),))
    # the rank's files and .metadata, not the parts (vouched for by the marker itself)
    assert {f.name for f in m.files} == \
        {f.name for f in whole.files if not layout.is_part(f.name)}
    assert all(m.file(f.name) == f for f in m.files)


def test_a_garbled_manifest_is_seen_by_whoever_reads_it(tmp_path: Path) -> None:
    d = _saved(tmp_path / "t1")
    _garble(d / layout.MANIFEST)
    assert verify_checkpoint(d, step=5, domain=(0,), world_size=1).step == 5  # not read
    with pytest.raises(IntegrityError, match=r"digest does not match manifest\.json"):
        verify_checkpoint(d, step=5)  # tierckpt verify, a reshard: the whole manifest
    with pytest.raises(IntegrityError, match=r"digest does not match manifest\.json"):
        verify_checkpoint(d, step=5, domain=(0,), world_size=2)  # another world size


def test_a_garbled_part_takes_the_whole_manifest(tmp_path: Path) -> None:
    d = _saved(tmp_path / "t1")
    _garble(d / layout.part_filename(0))
    with Reads(d) as reads:
        m = verify_checkpoint(d, step=5, domain=(0,), world_size=1)  # sizes: it passes
    assert layout.MANIFEST in {n for n, _ in reads.files}
    assert layout.part_filename(0) in {f.name for f in m.files}  # the whole manifest's
    with pytest.raises(IntegrityError, match=r"manifest\.00000\.json CRC32C"):
        verify_checkpoint(d, step=5, domain=(0,), world_size=1, full=True)


def test_a_missing_shard_is_damage_on_the_parts_path(tmp_path: Path) -> None:
    d = _saved(tmp_path / "t1")
    (d / "__0_0.distcp").unlink()
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp is missing"):
        verify_checkpoint(d, step=5, domain=(0,), world_size=1)


def test_a_step_renamed_by_hand_is_refused(tmp_path: Path) -> None:
    d = _saved(tmp_path / "t1")
    moved = d.with_name(layout.step_dirname(6))
    d.rename(moved)
    with pytest.raises(IntegrityError, match="renamed by hand"):
        verify_checkpoint(moved, step=6, domain=(0,), world_size=1)
