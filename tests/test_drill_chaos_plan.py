"""The chaos drill's fault catalogue and seeded plan (drill/chaos_plan.py), with values
alone: a seed names one plan, compounds never pair two job enders, kinds come when asked."""

from __future__ import annotations

from typing import Any

import pytest

from tierckpt.drill import chaos_plan as cp
from tierckpt.errors import ConfigError

# --- the plan --------------------------------------------------------------------------------


def test_plan_is_seeded_and_draws_one_or_two_kinds_per_cycle() -> None:
    a = cp.draw_plan(7, 40, nodes=2, save_every=3)
    assert a == cp.draw_plan(7, 40, nodes=2, save_every=3)
    assert a != cp.draw_plan(8, 40, nodes=2, save_every=3)
    assert [p.index for p in a] == list(range(1, 41))
    assert {len(p.faults) for p in a} == {1, 2}
    for p in a:
        assert len(set(p.kinds)) == len(p.kinds)  # a compound is two different kinds
        assert list(p.kinds) == sorted(p.kinds, key=lambda k: (
            cp.LIVE.index(k) if k in cp.LIVE else len(cp.LIVE)))  # live faults first, in order
        rest = [f.node for f in p.faults if f.kind in cp.AT_REST]
        assert len(rest) == len(set(rest))  # two at-rest faults hit different nodes
        assert 1 <= p.gap_saves <= 2 and 0 <= p.offset_steps < 3 and 1 <= p.outage_s <= 3
        for f in p.faults:
            assert 0 <= f.node < 2
            assert (f.variant is not None) == (f.kind in ("kill_rank", "kill_uploader",
                                                          "damage", "damage_ram"))
            assert f.kind not in cp.NOTICE_KINDS  # notices only when asked for
        assert not {"kill_rank", "kill_partner"} <= set(p.kinds)  # one kill ends the job
    drawn = {k for p in cp.draw_plan(1, 200, nodes=2) for k in p.kinds}
    assert drawn == set(cp.KINDS) - cp.NOTICE_KINDS - cp.HEAL_KINDS - cp.OBJECT_KINDS  # asked
    only = cp.draw_plan(3, 20, nodes=2, kinds=["kill_rank", "wipe_node"])
    assert {k for p in only for k in p.kinds} <= {"kill_rank", "wipe_node"}


def test_plan_without_tier0_is_the_plan_it_was() -> None:
    # the RAM kinds came last: a run without tier 0 draws what it drew before (the seed of
    # tests/test_drill_chaos.py still means its documented plan)
    without = [k for k in cp.KINDS
               if k not in cp.TIER0_KINDS | cp.NOTICE_KINDS | cp.HEAL_KINDS | cp.OBJECT_KINDS]
    assert cp.KINDS[:len(without)] == tuple(without)
    assert [p.as_dict()["faults"] for p in cp.draw_plan(2801, 3, nodes=2, kinds=without)] == [
        ["tier1_full@node1", "damage(missing_file)@node1"],
        ["kill_uploader(idle)@node1", "kill_rank(commit_window)@node0"], ["partial_commit@node1"]]
    ram = cp.draw_plan(5, 60, nodes=2)
    assert {k for p in ram for k in p.kinds} >= cp.TIER0_KINDS
    assert all(f.variant in cp.RAM_VARIANTS for p in ram for f in p.faults
               if f.kind == "damage_ram")
    assert {"kill_partner", "wipe_ram", "damage_ram"} <= cp.RESTART_KINDS


@pytest.mark.parametrize("kw", [{"kinds": ["meteor"]}, {"kinds": []}, {"nodes": 0},
                                {"cycles": 0}])
def test_plan_refuses_what_it_cannot_draw(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"cycles": 3, "nodes": 2, **kw}
    with pytest.raises(ConfigError):
        cp.draw_plan(0, args.pop("cycles"), **args)


def test_labels_restarts_and_budget() -> None:
    p = cp.CyclePlan(index=1, faults=(cp.Fault("tier2_down", 0), cp.Fault("kill_rank", 1,
                                                                          "in_save")),
                     gap_saves=2, offset_steps=1, outage_s=2.0, pick=0.5)
    assert [f.label for f in p.faults] == ["tier2_down@node0", "kill_rank(in_save)@node1"]
    assert p.restarts and not cp.CyclePlan(index=2, faults=(cp.Fault("kill_uploader", 0,
                                                                     "idle"),),
                                           gap_saves=1, offset_steps=0, outage_s=1.0,
                                           pick=0.0).restarts
    assert p.as_dict()["faults"] == ["tier2_down@node0", "kill_rank(in_save)@node1"]
    assert cp.steps_needed([p, p], save_every=3) == 2 * 4 * 3 + 6


def test_object_kinds_are_drawn_only_when_named() -> None:
    """Without ``kinds`` a plan never draws the object kinds (a seed's plan stays what it
    was); named, they are drawn with their variants."""
    default = cp.draw_plan(3, 40, nodes=2)
    assert not {f.kind for c in default for f in c.faults} & cp.OBJECT_KINDS
    named = cp.draw_plan(3, 40, nodes=2, kinds=["damage_object", "cut_deletion"])
    faults = [f for c in named for f in c.faults]
    assert {f.kind for f in faults} == cp.OBJECT_KINDS <= cp.AT_REST
    assert {f.variant for f in faults if f.kind == "damage_object"} == set(cp.OBJECT_VARIANTS)
