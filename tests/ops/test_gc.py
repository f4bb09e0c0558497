"""cleanup.plan_gc from values: retention's guarantees hold for gc."""

from __future__ import annotations

import pytest

from tierckpt.errors import ConfigError
from tierckpt.ops.gc import GcPolicy, plan_gc


def test_keep_last_pins_and_newest() -> None:
    p = plan_gc(GcPolicy(keep_last=2), tier1_complete=[5, 1, 3, 2, 4], pinned=[1])
    assert p.tier1 == (2, 3)
    assert p.tier1_kept == {5: "newest", 4: "keep-last 2", 1: "pinned"}
    assert p.tier2 is None and p.applied is False


def test_newest_survives_even_when_pinned_elsewhere_and_keep_last_1() -> None:
    p = plan_gc(GcPolicy(keep_last=1), tier1_complete=[7, 8, 9])
    assert p.tier1 == (7, 8) and list(p.tier1_kept) == [9]


def test_upload_holds_only_when_the_root_has_an_uploader() -> None:
    steps = [10, 20, 30, 40]
    no_uploader = plan_gc(GcPolicy(keep_last=1), tier1_complete=steps, uploaded=None)
    assert no_uploader.tier1 == (10, 20, 30)
    # 20 uploaded; 30 and 40 are due and newer: kept until the uploader copies them
    held = plan_gc(GcPolicy(keep_last=1), tier1_complete=steps, uploaded={20})
    assert held.tier1 == (10, 20)
    assert held.tier1_kept == {40: "newest", 30: "not yet on tier 2"}
    # nothing uploaded yet: every due step is held
    assert plan_gc(GcPolicy(keep_last=1), tier1_complete=steps, uploaded=set()).tier1 == ()
    # the policy decides what is due: with upload_every=20, 30 is never uploaded
    p = plan_gc(GcPolicy(keep_last=1, upload_every=20), tier1_complete=steps, uploaded={20})
    assert p.tier1 == (10, 20, 30)


def test_tier2_keep_last_and_every() -> None:
    p = plan_gc(GcPolicy(tier2_keep_last=2, tier2_keep_every=100), tier1_complete=[],
                tier2_complete=[50, 100, 150, 200, 250, 300])
    assert p.tier2 == (50, 150)
    assert p.tier2_kept == (300, 250, 200, 100)
    assert p.to_json()["tier2"] == {"delete": [50, 150], "keep": [300, 250, 200, 100]}


def test_stale_names_are_listed_sorted() -> None:
    p = plan_gc(GcPolicy(), tier1_complete=[1], tier1_stale=["b.tmp", "a.tmp"])
    assert p.tier1_stale == ("a.tmp", "b.tmp") and p.tier1 == ()


@pytest.mark.parametrize(("kw", "name"), [({"keep_last": 0}, "keep-last"),
                                          ({"upload_every": 0}, "upload-every"),
                                          ({"tier2_keep_last": 0}, "tier2-keep-last"),
                                          ({"tier2_keep_every": -1}, "tier2-keep-every")])
def test_policy_names_the_bad_knob(kw: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        GcPolicy(**kw)
