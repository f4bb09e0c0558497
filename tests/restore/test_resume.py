"""Resume selection against damaged tier-1 contents: each bad candidate is skipped with a
reason, moved to quarantine (never deleted), and the next older one is restored."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt.errors import CorruptDataError, StateMismatchError
from tierckpt.format import layout
from tierckpt.runtime import events


def _state() -> tierckpt.TrainState:
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    return tierckpt.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _two_checkpoints(root: Path) -> None:
    st = _state()
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(1, st)
        ck.wait_for_staging()  # the write below is not an optimizer step
        with torch.no_grad():
            st.model.weight.add_(1.0)
        ck.save(2, st).wait()


def _biggest_shard(d: Path) -> Path:
    return max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _truncate(d: Path) -> None:
    p = _biggest_shard(d)
    os.truncate(p, p.stat().st_size // 2)


def _flip(d: Path, name: str | None = None) -> None:
    p = d / name if name else _biggest_shard(d)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _drop_marker(d: Path) -> None:
    (d / layout.COMPLETE).unlink()


def _bad_digest(d: Path) -> None:
    body = json.loads((d / layout.COMPLETE).read_text())
    body["manifest_sha256"] = "0" * 64
    (d / layout.COMPLETE).write_text(json.dumps(body))


def _edit_manifest_and_part(d: Path) -> None:
    _flip(d, layout.MANIFEST)  # alone, the parts rebuild it (below)
    _flip(d, layout.part_filename(0))


def _flip_marker_digest(d: Path) -> None:
    body = json.loads((d / layout.COMPLETE).read_text())
    digest = body["manifest_sha256"]  # another first digit: "f" + digest[1:] was a no-op 1 in 16
    body["manifest_sha256"] = ("0" if digest[0] != "0" else "1") + digest[1:]
    (d / layout.COMPLETE).write_text(json.dumps(body, sort_keys=True) + "\n")


def _delete_shard(d: Path) -> None:
    _biggest_shard(d).unlink()


@pytest.mark.parametrize("damage, verify, reason", [
    (_truncate, "sizes", "bytes, manifest says"),
    (_flip, "full", "CRC32C"),
    (lambda d: _flip(d, layout.METADATA), "full", "CRC32C"),
    (_drop_marker, "sizes", "no COMPLETE"),
    (_bad_digest, "sizes", "digest"),
    (_edit_manifest_and_part, "sizes", "digest"),
    (_flip_marker_digest, "sizes", "damaged"),
    (_delete_shard, "sizes", "missing"),
])
def test_damaged_newest_is_skipped_and_previous_used(
        tmp_path: Path, damage: Callable[[Path], None], verify: str, reason: str) -> None:
    _two_checkpoints(tmp_path)
    damage(tmp_path / "step-00000002")
    st = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path, verify=verify) as ck:
        info = ck.restore(st)
    assert info is not None and info.step == 1
    assert len(info.skipped) == 1 and info.skipped[0][0] == 2 and reason in info.skipped[0][1]
    assert not (tmp_path / "step-00000002").exists()
    (q,) = (tmp_path / layout.QUARANTINE).iterdir()
    assert q.name.startswith("step-00000002") and reason in (q / "QUARANTINE_REASON").read_text()
    skipped = [e for e in events.read_events(tmp_path / layout.EVENTS)
               if e["event"] == "checkpoint_skipped"]
    assert skipped[0]["step"] == 2 and reason in skipped[0]["reason"]


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_manifest_beside_its_parts_loses_nothing(tmp_path: Path, damage: str) -> None:
    """``manifest.json`` is redundant beside its parts: the restore reads only the parts it
    needs (each checked against the marker), and whoever reads the whole manifest gets it
    rebuilt from them, byte for byte what the marker vouches for."""
    from tierckpt.tier1.catalog import read_committed
    _two_checkpoints(tmp_path)
    d = tmp_path / "step-00000002"
    intact = (d / layout.MANIFEST).read_bytes()
    _flip(d, layout.MANIFEST) if damage == "flip" else (d / layout.MANIFEST).unlink()
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        info = ck.restore(_state())
    assert info is not None and info.step == 2 and info.skipped == ()
    assert read_committed(d, step=2).manifest_bytes == intact


def test_directory_renamed_by_hand_is_skipped(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    os.rename(tmp_path / "step-00000001", tmp_path / "step-00000009")
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        info = ck.restore(_state())
    assert info is not None and info.step == 2
    assert any("renamed" in r for _, r in info.skipped)


def test_all_damaged_means_fresh_start_but_nothing_deleted(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    _drop_marker(tmp_path / "step-00000001")
    _drop_marker(tmp_path / "step-00000002")
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        assert ck.restore(_state()) is None
    assert len(list((tmp_path / layout.QUARANTINE).iterdir())) == 2


def test_symlinked_candidate_is_refused(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    os.rename(tmp_path / "step-00000002", elsewhere)
    os.symlink(elsewhere, tmp_path / "step-00000002")
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        info = ck.restore(_state())
    assert info is not None and info.step == 1
    assert (elsewhere / layout.COMPLETE).exists()  # the link target is never touched


def test_a_flipped_byte_under_sizes_is_caught_while_reading(tmp_path: Path) -> None:
    """verify="sizes" never reads the shards before loading; the reader checks each file's
    CRC32C from the bytes it reads, so the damage is found at load, the step quarantined
    and the previous one restored."""
    _two_checkpoints(tmp_path)
    _flip(tmp_path / "step-00000002")
    st = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path, verify="sizes") as ck:
        info = ck.restore(st)
    assert info is not None and info.step == 1
    (reason,) = [r for s, r in info.skipped if s == 2]
    assert "found while reading" in reason or "Unpickling" in reason or "Zip" in reason
    assert torch.equal(st.model.weight, _state().model.weight)  # step 1's weights, whole
    (q,) = (tmp_path / layout.QUARANTINE).iterdir()
    assert q.name.startswith("step-00000002")


def test_the_only_checkpoint_failing_to_load_says_the_state_is_dirty(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    _flip(tmp_path / "step-00000001")
    _flip(tmp_path / "step-00000002")
    with tierckpt.CheckpointManager(tier1=tmp_path, verify="sizes") as ck, \
            pytest.raises(CorruptDataError, match="build it anew"):
        ck.restore(_state())


def test_a_model_that_changed_is_a_clear_error_and_nothing_is_quarantined(
        tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    torch.manual_seed(0)
    wider = nn.Linear(64, 80)
    st = tierckpt.TrainState(model=wider, optimizer=torch.optim.SGD(wider.parameters(), lr=0.1))
    before = wider.weight.detach().clone()
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck, \
            pytest.raises(StateMismatchError, match=r"model\.weight: checkpoint \(64, 64\), "
                                                    r"state \(80, 64\).*nothing was loaded"):
        ck.restore(st)
    assert torch.equal(wider.weight, before)
    assert not (tmp_path / layout.QUARANTINE).exists()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001",
                                                               "step-00000002"]


def test_a_damaged_tier1_copy_is_taken_from_tier2_at_the_same_step(tmp_path: Path) -> None:
    """Same step first: step 2's tier-1 shard has a flipped byte, and tier 2 holds step 2
    verified. The restore sets the tier-1 copy aside and loads step 2 from tier 2 — no
    step is redone — instead of falling back to step 1."""
    root, bucket = tmp_path / "t1", tmp_path / "bucket"
    bucket.mkdir()
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, tier2=tierckpt.Tier2(bucket.as_uri())) as ck:
        ck.save(1, st)
        ck.wait_for_staging()
        with torch.no_grad():
            st.model.weight.add_(1.0)
        ck.save(2, st).wait()
    assert (bucket / "step-00000002" / layout.COMPLETE).is_file()  # close() drained it
    want = st.model.weight.detach().clone()
    _flip(root / "step-00000002")
    got = _state()
    with tierckpt.CheckpointManager(
            tier1=root, tier2=tierckpt.Tier2(bucket.as_uri(), start_uploader=False)) as ck:
        info = ck.restore(got)
    assert info is not None and info.step == 2 and info.source == "tier2", info
    assert info.bytes_by_source["tier2"] > 0
    assert [s for s, _ in info.skipped] == [2]  # the tier-1 copy, with its reason
    assert torch.equal(got.model.weight, want)
    (q,) = (root / layout.QUARANTINE).iterdir()  # kept aside, never deleted silently
    assert q.name.startswith("step-00000002")


def test_without_another_copy_the_previous_step_is_restored(tmp_path: Path) -> None:
    """The same damage with a tier 2 that lacks step 2: the restore goes on to step 1."""
    _two_checkpoints(tmp_path / "t1")
    bucket = tmp_path / "empty-bucket"
    bucket.mkdir()
    _flip(tmp_path / "t1" / "step-00000002")
    with tierckpt.CheckpointManager(
            tier1=tmp_path / "t1",
            tier2=tierckpt.Tier2(bucket.as_uri(), start_uploader=False)) as ck:
        info = ck.restore(_state())
    assert info is not None and info.step == 1 and info.source == "tier1"
    assert [s for s, _ in info.skipped] == [2]


def _tier2_only(tmp_path: Path) -> Path:
    """Steps 1 and 2 uploaded to a file:// tier 2 (its directory returned)."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    _two_checkpoints_to(tmp_path / "t1", bucket)
    return bucket


def _keys(bucket: Path, step: int) -> dict[str, str]:
    """Member name → content key, from ``step``'s map on tier 2."""
    m = json.loads((bucket / layout.step_dirname(step) / "objects.json").read_text())
    return {e["name"]: e["key"] for e in m["entries"]}


def _two_checkpoints_to(root: Path, bucket: Path) -> None:
    st = _state()
    with tierckpt.CheckpointManager(tier1=root, tier2=tierckpt.Tier2(bucket.as_uri())) as ck:
        ck.save(1, st).wait()
        deadline = time.monotonic() + 60
        while not (bucket / "step-00000001" / layout.COMPLETE).is_file():  # uploaded
            assert time.monotonic() < deadline, "step 1 never reached tier 2"
            time.sleep(0.05)
        with torch.no_grad():
            st.model.weight.add_(1.0)
        ck.save(2, st).wait()
    assert (bucket / "step-00000002" / layout.COMPLETE).is_file()  # close() drained it


def _restore_fresh(tmp_path: Path, bucket: Path) -> tuple[tierckpt.RestoreInfo | None, Path]:
    fresh = tmp_path / "fresh"
    with tierckpt.CheckpointManager(
            tier1=fresh, tier2=tierckpt.Tier2(bucket.as_uri(), start_uploader=False)) as ck:
        info = ck.restore(_state())
    return info, fresh


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_or_missing_object_on_tier2_falls_back_to_the_step_before(
        tmp_path: Path, damage: str) -> None:
    """A new node (empty tier 1) whose newest tier-2 step has a content object flipped or
    deleted behind the job's back: that step is skipped with the reason logged, the one
    before is restored from tier 2, and the failed fetch leaves nothing on tier 1."""
    bucket = _tier2_only(tmp_path)
    keys = _keys(bucket, 2)
    obj = bucket / max((k for n, k in keys.items() if n.endswith(".distcp")),
                       key=lambda k: (bucket / k).stat().st_size)
    if damage == "flip":
        _flip(obj.parent, obj.name)
    else:
        obj.unlink()
    info, fresh = _restore_fresh(tmp_path, bucket)
    assert info is not None and info.step == 1 and info.source == "tier2", info
    ((step, reason),) = info.skipped
    assert step == 2 and "fetching step 2 from tier 2 failed" in reason
    assert ("no such object" if damage == "delete" else "crc32c") in reason
    skipped = [e for e in events.read_events(fresh / layout.EVENTS)
               if e["event"] == events.CHECKPOINT_SKIPPED]
    assert [e["step"] for e in skipped] == [2]
    assert sorted(p.name for p in fresh.glob("step-*")) == ["step-00000001"]  # no tmp left


def test_every_tier2_step_damaged_is_a_fresh_start_that_keeps_them(tmp_path: Path) -> None:
    """As with tier 1: nothing readable anywhere is a fresh start, each step skipped with
    its reason; tier 2 keeps both steps (nothing is deleted)."""
    bucket = _tier2_only(tmp_path)
    for k in {_keys(bucket, s)[".metadata"] for s in (1, 2)}:
        _flip((bucket / k).parent, (bucket / k).name)
    info, _ = _restore_fresh(tmp_path, bucket)
    assert info is None
    assert (bucket / "step-00000001" / layout.COMPLETE).is_file()
    assert (bucket / "step-00000002" / layout.COMPLETE).is_file()
