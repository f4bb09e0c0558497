"""Where tier 0 lives, one rule: an explicit path wins; else ``$TIERCKPT_TIER0`` (the
directory a launch kit sets up, e.g. the RAM volume of ``launch k8s --tier0-size``); else
``$TIERCKPT_TIER0_BASE``; else /dev/shm/tierckpt. And a tier-0 string that is no absolute
directory (``tier0="yes"``) is a configuration error, never a directory made in the
working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import Tier0
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.tier0.config import as_tier0
from tierckpt.tier0.root import BASE_ENV, DEFAULT_BASE, TIER0_ENV, auto_base, job_key


@pytest.mark.parametrize("value", ["yes", "true", "1", "ram", "./shm"])
def test_a_relative_tier0_is_refused_and_nothing_is_made(
        value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="is not an absolute directory: give one on tmpfs"):
        tierckpt.ManagerConfig(tier1=tmp_path / "t1", tier0=value)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_an_absolute_tier0_is_a_path(shm: Path) -> None:
    t0 = as_tier0(str(shm / "job"))
    assert t0 is not None and t0.path == shm / "job"
    home = as_tier0("~/ram")
    assert home is not None and home.path == Path.home() / "ram"


def test_the_base_is_the_kits_volume_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIER0_ENV, raising=False)
    monkeypatch.delenv(BASE_ENV, raising=False)
    assert auto_base() == DEFAULT_BASE
    monkeypatch.setenv(BASE_ENV, "/dev/shm/base")
    assert auto_base() == Path("/dev/shm/base")
    monkeypatch.setenv(TIER0_ENV, "/tierckpt/tier0")
    assert auto_base() == Path("/tierckpt/tier0")


def _state() -> tierckpt.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return tierckpt.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1))


def test_tier0_uses_the_directory_the_kit_sets(tmp_path: Path, shm: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``Tier0()`` under a kit that set ``TIERCKPT_TIER0``: the saves land in that volume
    (a root named for the job's tier-1 root), not in /dev/shm/tierckpt."""
    volume = shm / "volume"
    volume.mkdir()
    monkeypatch.setenv(TIER0_ENV, str(volume))
    monkeypatch.setenv(BASE_ENV, str(shm / "base"))  # loses to the kit's
    t1 = tmp_path / "t1"
    with tierckpt.CheckpointManager(tier1=t1, tier0=Tier0(tier1_every=100)) as ck:
        state = _state()
        ck.save(3, state).wait(30)
        result = ck.save(4, state).wait(30)
        assert result is not None and result.tier == "tier0"  # in RAM only
        assert ck.tier0 is not None and ck.tier0.path == volume / job_key(t1)
        assert (volume / job_key(t1) / layout.step_dirname(4) / layout.COMPLETE).exists()
    assert not (shm / "base").exists()
    # an explicit path wins over the kit's
    own = shm / "own"
    with tierckpt.CheckpointManager(tier1=tmp_path / "t2", tier0=Tier0(own)) as ck:
        assert ck.tier0 is not None and ck.tier0.path == own
    assert os.environ[TIER0_ENV] == str(volume)
