"""Tier 0 in one process: saves land in RAM (a tmpfs directory), every tier1_every-th on
disk too, the newest RAM-only one reaches the disk at close; restore prefers RAM; the RAM
budget is checked with the numbers in the message; another job's tier 0 is never used."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt import Tier0
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.runtime import events
from tierckpt.tier0.root import BASE_ENV, JOB_FILE, default_root, remove_dead_roots
from tierckpt.tier1.lock import FileLock


def _state(seed: int = 0) -> tuple[tierckpt.TrainState, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierckpt.TrainState(model=model, optimizer=opt, extra={"n": 0}), model


def _train(state: tierckpt.TrainState, n: int) -> list[float]:
    out = []
    for _ in range(n):
        loss = state.model(torch.randn(8, 32)).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.extra["n"] += 1
        out.append(loss.item())
    return out


def _events(root: Path, kind: str) -> list[dict]:
    return [e for e in events.read_events(root / layout.EVENTS) if e["event"] == kind]


def test_saves_land_in_ram_and_every_kth_on_disk(tmp_path: Path, shm: Path) -> None:
    st, _ = _state()
    # keep_on_close: the next incarnation of this job (a requeue) restores from RAM
    kw = dict(tier1=tmp_path / "t1",
              tier0=Tier0(shm / "t0", tier1_every=2, keep=2, keep_on_close=True))
    with tierckpt.CheckpointManager(**kw) as ck:
        tiers = []
        for step in (1, 2, 3, 4):
            _train(st, 2)
            tiers.append(ck.save(step, st).wait(30).tier)
        assert tiers == ["tier1", "tier0", "tier1", "tier0"]
        ref = _train(st, 3)
    # step 4 lived in RAM only: close() copied it to tier 1
    disk = sorted(p.name for p in (tmp_path / "t1").iterdir() if p.name.startswith("step-"))
    assert disk == ["step-00000001", "step-00000003", "step-00000004"]
    ram = sorted(p.name for p in (shm / "t0").iterdir() if p.name.startswith("step-"))
    assert ram == ["step-00000003", "step-00000004"]  # Tier0.keep=2
    assert len(_events(tmp_path / "t1", events.TIER0_SAVED)) == 4
    st2, _ = _state(seed=9)
    with tierckpt.CheckpointManager(**kw) as ck:
        info = ck.restore(st2)
        assert info is not None and info.step == 4 and info.source == "tier0"
        assert info.bytes_by_source["tier0"] > 0 and info.bytes_by_source["tier1"] == 0
        assert _train(st2, 3) == ref


def test_damaged_ram_falls_back_to_disk(tmp_path: Path, shm: Path) -> None:
    st, _ = _state()
    kw = dict(tier1=tmp_path / "t1", tier0=Tier0(shm / "t0", keep_on_close=True))
    with tierckpt.CheckpointManager(**kw) as ck:
        _train(st, 2)
        ck.save(1, st).wait(30)
        ref = _train(st, 3)
    shard = shm / "t0" / layout.step_dirname(1) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    st2, _ = _state(seed=5)
    with tierckpt.CheckpointManager(**kw) as ck:
        info = ck.restore(st2)
        assert info is not None and info.step == 1 and info.source == "tier1"
        assert _train(st2, 3) == ref
    reasons = [e["reason"] for e in _events(tmp_path / "t1", events.CHECKPOINT_SKIPPED)]
    assert any(r.startswith("tier 0:") and "CRC32C" in r for r in reasons)
    assert not (shm / "t0" / layout.step_dirname(1)).exists()  # the bad RAM copy is gone


def test_a_clean_close_gives_the_ram_back_once_the_newest_is_on_tier1(
        tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    st, _ = _state()
    with caplog.at_level(logging.INFO, logger="tierckpt"), tierckpt.CheckpointManager(
            tier1=tmp_path / "t1", tier0=Tier0(shm / "t0", tier1_every=2)) as ck:
        for step in (1, 2):
            _train(st, 2)
            ck.save(step, st).wait(30)
        assert (shm / "t0" / layout.step_dirname(2)).exists()  # in RAM only until close
    assert not (shm / "t0").exists()
    assert (tmp_path / "t1" / layout.step_dirname(2) / layout.COMPLETE).exists()  # flushed
    assert any("removed this node's RAM copies" in r.getMessage() for r in caplog.records)
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=Tier0(shm / "t0")) as ck:
        info = ck.restore(_state(seed=3)[0])
    assert info is not None and info.step == 2 and info.source == "tier1"


def test_a_crash_keeps_the_ram_copies(tmp_path: Path, shm: Path) -> None:
    st, _ = _state()
    with pytest.raises(RuntimeError, match="the loop died"), tierckpt.CheckpointManager(
            tier1=tmp_path / "t1", tier0=Tier0(shm / "t0", tier1_every=2)) as ck:
        for step in (1, 2):
            _train(st, 2)
            ck.save(step, st).wait(30)
        raise RuntimeError("the loop died")
    assert (shm / "t0" / layout.step_dirname(2) / layout.COMPLETE).exists()


def test_the_ram_budget_is_checked_with_the_numbers(tmp_path: Path, shm: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path / "a",
                                    tier0=Tier0(shm / "a", keep=10**9)) as ck, \
            pytest.raises(ConfigError, match=r"tier 0 needs .* GiB .* GiB free .* GiB of RAM"):
        ck.save(1, st)


def test_auto_runs_without_tier0_when_it_does_not_fit(tmp_path: Path, shm: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BASE_ENV, str(shm / "base"))
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=Tier0(keep=10**9)) as ck:
        assert ck.save(1, st).wait(30).tier == "tier1"
        assert ck.tier0 is None
    (e,) = _events(tmp_path / "t1", events.TIER0_DISABLED)
    assert "GiB" in e["reason"]
    with tierckpt.CheckpointManager(tier1=tmp_path / "t2", tier0=Tier0()) as ck:
        assert ck.save(1, st).wait(30).tier == "tier1"  # tier1_every=1
        assert ck.tier0 is not None and ck.tier0.path == default_root(tmp_path / "t2")
        assert ck.tier0.path.parent == shm / "base"


def test_another_jobs_tier0_is_never_used(tmp_path: Path, shm: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BASE_ENV, str(shm / "base"))
    root = shm / "t0"
    root.mkdir()
    (root / JOB_FILE).write_text(json.dumps({"tier1": "/elsewhere/t1"}))
    (root / layout.step_dirname(7)).mkdir()  # whatever it holds is not ours
    with pytest.raises(ConfigError, match="belongs to another job"):
        tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=root)
    assert (root / layout.step_dirname(7)).exists()  # and nothing of it was removed
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path / "t1", tier0=Tier0()) as ck:
        assert ck.restore(st) is None  # "auto" keys its root by the tier-1 root


def test_dead_jobs_roots_are_removed_live_and_recent_ones_kept(shm: Path) -> None:
    def root(name: str, age: float) -> Path:
        p = shm / name
        p.mkdir()
        (p / JOB_FILE).write_text("{}")
        os.utime(p / JOB_FILE, (time.time() - age, time.time() - age))
        return p

    dead, recent, live = root("dead", 7200), root("recent", 60), root("live", 7200)
    lock = FileLock(live / ".lock", busy="held")
    try:
        other = shm / "not-tier0"
        other.mkdir()
        assert remove_dead_roots(shm, keep=shm / "mine") == [dead]
        assert recent.exists() and live.exists() and other.exists()
    finally:
        lock.release()


@pytest.mark.parametrize("kw,match", [
    ({"tier0": 5}, "tier0 must be"), ({"tier0": ""}, "tier0 must be"),
    ({"tier0": Tier0()}, None),
])
def test_bad_tier0_settings_say_what_to_fix(tmp_path: Path, kw: dict, match: str | None) -> None:
    if match is None:
        assert tierckpt.ManagerConfig(tier1=tmp_path, **kw).tier0 == Tier0()
        return
    with pytest.raises(ConfigError, match=match):
        tierckpt.ManagerConfig(tier1=tmp_path, **kw)
