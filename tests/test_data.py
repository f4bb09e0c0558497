from __future__ import annotations

import warnings

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import tierckpt
from tierckpt.data import ResumableSampler
from tierckpt.errors import ConfigError

N = 50


def _loaders(world: int, seed: int = 3) -> list[StatefulDataLoader]:
    return [StatefulDataLoader(list(range(N)), batch_size=4, num_workers=0,
                               sampler=ResumableSampler(N, rank=r, world_size=world, seed=seed))
            for r in range(world)]


def test_same_world_resume_is_exact() -> None:
    (a,), (b,) = _loaders(1), _loaders(1)
    it = iter(a)
    for _ in range(3):
        next(it)
    b.load_state_dict(a.state_dict())
    assert [x.tolist() for x in b][:4] == [next(it).tolist() for _ in range(4)]


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_reshard_continues_without_repeats_or_skips(new_world: int) -> None:
    old = _loaders(2)
    its = [iter(ld) for ld in old]
    seen = [i for _ in range(3) for it in its for i in next(it).tolist()]
    state = old[0].state_dict()
    assert state == old[1].state_dict() or \
        state["_sampler_iter_state"]["sampler_state"] == old[1].state_dict()[
            "_sampler_iter_state"]["sampler_state"]
    new = _loaders(new_world)
    for ld in new:
        ld.load_state_dict(state)
    rest = [i for ld in new for b in ld for i in b.tolist()]
    assert not set(seen) & set(rest)                      # nothing repeated
    assert len(rest) == len(set(rest))
    tail = N - len(seen) - len(rest)
    assert 0 <= tail < new_world * 4                      # only a short epoch tail is dropped


def test_epochs_advance_and_differ() -> None:
    s = ResumableSampler(N, rank=0, world_size=1, seed=1)
    e0, e1 = list(s), list(s)
    assert sorted(e0) == sorted(e1) == list(range(N)) and e0 != e1


def test_bad_input() -> None:
    with pytest.raises(ConfigError):
        ResumableSampler(0, rank=0, world_size=1)
    with pytest.raises(ConfigError):
        ResumableSampler(5, rank=2, world_size=2)
    s = ResumableSampler(5, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="same dataset"):
        s.load_state_dict({"epoch": 0, "position": 0, "n": 6})


# --- the exactness guard: a loader whose iterator draws from the global RNG ------------------

def _loader(**kw: object) -> StatefulDataLoader:
    return StatefulDataLoader(list(range(32)), batch_size=4, **kw)  # type: ignore[arg-type]


def test_a_loader_without_its_own_generator_is_named_with_the_fix() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match=r"generator=torch\.Generator\(\)") as rec:
        tierckpt.TrainState(model=model, dataloader=_loader(shuffle=True))
    ours = [str(w.message) for w in rec if "global torch RNG" in str(w.message)]
    assert len(ours) == 1 and "strict=True" in ours[0], ours
    with pytest.raises(ConfigError, match="global torch RNG"):
        tierckpt.TrainState(model=model, dataloader=_loader(shuffle=True), strict=True)
    sampler = torch.utils.data.RandomSampler(list(range(32)))
    with pytest.raises(ConfigError, match="RandomSampler"):
        tierckpt.TrainState(model=model, strict=True,
                            dataloader=_loader(sampler=sampler, generator=torch.Generator()))


def test_a_loader_with_its_own_generator_passes_silently() -> None:
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*global torch RNG")
        tierckpt.TrainState(model=model, strict=True,
                            dataloader=_loader(shuffle=True, generator=torch.Generator()))
        tierckpt.TrainState(model=model, strict=True, dataloader=_loader(
            sampler=tierckpt.ResumableSampler(32), generator=torch.Generator()))


def test_the_guard_is_about_exactness_it_catches_a_real_drift() -> None:
    """Why it matters: iter() of a loader without a generator moves the global RNG."""
    torch.manual_seed(0)
    iter(_loader(shuffle=True))
    after = torch.rand(1)
    torch.manual_seed(0)
    iter(_loader(shuffle=True, generator=torch.Generator()))
    assert not torch.equal(after, torch.rand(1))
