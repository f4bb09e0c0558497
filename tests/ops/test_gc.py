"""cleanup.plan_gc from values: retention's guarantees hold for gc; collect on a
content-addressed tier 2 with a step of the old layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._synthetic import make_checkpoint
from tests.tier2.test_content import BASE, derive
from tierckpt.errors import ConfigError
from tierckpt.format import layout
from tierckpt.ops.check import check_tier2
from tierckpt.ops.gc import GcPolicy, collect, plan_gc
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage
from tierckpt.tier2.uploader.transfer import upload_step


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


def test_collect_cleans_an_old_layout_step_and_unreferenced_content(tmp_path: Path) -> None:
    """gc --tier2 deletes a step written before content addressing (every member under
    its prefix) and a content-addressed one, and keeps what the newest still refers to."""
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    st = LocalStorage(t2)
    make_checkpoint(t1, 1, BASE)
    for name in (*BASE, layout.MANIFEST, layout.COMPLETE):  # the old layout, by hand
        st.put_bytes(Tier2Catalog.key(1, name), (t1 / "step-00000001" / name).read_bytes())
    derive(t1, 1, 2, changed={"__0_1.distcp"})
    derive(t1, 2, 3, changed={"__0_1.distcp"})
    for step in (2, 3):
        upload_step(Tier1Catalog(t1), Tier2Catalog(st), step,
                    log=events.EventLog(t1 / layout.EVENTS))
    plan = collect(t1, GcPolicy(keep_last=3, tier2_keep_last=1), storage=st, apply=True)
    assert plan.tier2 == (1, 2)
    remote = Tier2Catalog(st)
    kept = remote.resolve(3).objmap
    assert remote.complete_steps() == [3] and kept is not None
    assert {i.key.split("/")[0] for i in st.list()} == {"objects", "step-00000003"}
    assert set(remote.content()) == set(kept.keys().values())
    assert check_tier2(st, 3).ok
