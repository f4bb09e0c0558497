"""The chaos drill's pure logic with values alone: the seeded plan, the expected restore
point, every invariant passing and failing, the per-kind summary and the report."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.chaos_report import build_chaos_report, render_chaos_markdown
from tierckpt.errors import ConfigError

# --- the plan --------------------------------------------------------------------------------


def test_plan_is_seeded_and_draws_one_or_two_kinds_per_cycle() -> None:
    a = cv.draw_plan(7, 40, nodes=2, save_every=3)
    assert a == cv.draw_plan(7, 40, nodes=2, save_every=3)
    assert a != cv.draw_plan(8, 40, nodes=2, save_every=3)
    assert [p.index for p in a] == list(range(1, 41))
    assert {len(p.faults) for p in a} == {1, 2}
    for p in a:
        assert len(set(p.kinds)) == len(p.kinds)  # a compound is two different kinds
        assert list(p.kinds) == sorted(p.kinds, key=lambda k: (
            cv.LIVE.index(k) if k in cv.LIVE else len(cv.LIVE)))  # live faults first, in order
        rest = [f.node for f in p.faults if f.kind in cv.AT_REST]
        assert len(rest) == len(set(rest))  # two at-rest faults hit different nodes
        assert 1 <= p.gap_saves <= 2 and 0 <= p.offset_steps < 3 and 1 <= p.outage_s <= 3
        for f in p.faults:
            assert 0 <= f.node < 2
            assert (f.variant is not None) == (f.kind in ("kill_rank", "kill_uploader",
                                                          "damage"))
    drawn = {k for p in cv.draw_plan(1, 200, nodes=2) for k in p.kinds}
    assert drawn == set(cv.KINDS)
    only = cv.draw_plan(3, 20, nodes=2, kinds=["kill_rank", "wipe_node"])
    assert {k for p in only for k in p.kinds} <= {"kill_rank", "wipe_node"}


@pytest.mark.parametrize("kw", [{"kinds": ["meteor"]}, {"kinds": []}, {"nodes": 1},
                                {"cycles": 0}])
def test_plan_refuses_what_it_cannot_draw(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"cycles": 3, "nodes": 2, **kw}
    with pytest.raises(ConfigError):
        cv.draw_plan(0, args.pop("cycles"), **args)


def test_labels_restarts_and_budget() -> None:
    p = cv.CyclePlan(index=1, faults=(cv.Fault("tier2_down", 0), cv.Fault("kill_rank", 1,
                                                                          "in_save")),
                     gap_saves=2, offset_steps=1, outage_s=2.0, pick=0.5)
    assert [f.label for f in p.faults] == ["tier2_down@node0", "kill_rank(in_save)@node1"]
    assert p.restarts and not cv.CyclePlan(index=2, faults=(cv.Fault("kill_uploader", 0,
                                                                     "idle"),),
                                           gap_saves=1, offset_steps=0, outage_s=1.0,
                                           pick=0.0).restarts
    assert p.as_dict()["faults"] == ["tier2_down@node0", "kill_rank(in_save)@node1"]
    assert cv.steps_needed([p, p], save_every=3) == 2 * 4 * 3 + 6
    assert cv.tier1_bound(3, 2) == 7 and cv.tier1_bound(3, None) is None


# --- the expected restore point --------------------------------------------------------------

def test_expected_is_the_newest_step_every_node_can_restore() -> None:
    complete = {0: {6, 9, 12}, 1: {6, 9, 12}}
    assert cv.expected_restore(complete, {}, set()) == 12
    assert cv.expected_restore(complete, {1: {12}}, set()) == 9  # damaged on one node
    assert cv.expected_restore(complete, {1: {12}}, {12}) == 12  # ... but on tier 2
    assert cv.expected_restore({0: {6, 9, 12}, 1: {6, 9}}, {}, None) == 9  # partial commit
    assert cv.expected_restore({0: {6, 9}, 1: set()}, {}, {6}) == 6  # a replaced node
    assert cv.expected_restore({0: {9}, 1: {9}}, {}, {9, 15}) == 15  # tier 2 is newer
    assert cv.expected_restore({0: set(), 1: set()}, {}, set()) is None  # a fresh start


def test_expected_is_refuse_when_only_some_nodes_could_restore() -> None:
    assert cv.expected_restore({0: {6, 9}, 1: set()}, {}, None) == "refuse"
    assert cv.expected_restore({0: {9}, 1: {9}}, {1: {9}}, set()) == "refuse"


# --- each invariant passes, and each can fail -----------------------------------------------

NODE_OF = {0: 0, 1: 1}


def test_resume_passes_for_the_expected_step_read_safely() -> None:
    v = cv.resume_verdict({0: 12, 1: 12}, {12}, tier2_bytes={0: 0, 1: 0}, lacking={},
                          node_of=NODE_OF)
    assert v.ok and v.name == "resume"
    v = cv.resume_verdict({0: 12, 1: 12}, {12}, tier2_bytes={0: 0, 1: 800},
                          lacking={1: {12}}, node_of=NODE_OF)
    assert v.ok  # node 1's copy was damaged and it fetched the step from tier 2
    assert cv.resume_verdict({0: None, 1: None}, {None}, tier2_bytes={}, lacking={},
                             node_of=NODE_OF).ok  # a fresh start where nothing existed


@pytest.mark.parametrize("chosen, acceptable, t2, lacking, word", [
    ({0: 9, 1: 9}, {12}, {}, {}, "expected 12"),  # an older one than the newest intact
    ({0: 12, 1: 9}, {12}, {}, {}, "different steps"),
    ({0: 12, 1: 12}, {12}, {0: 0, 1: 0}, {1: {12}}, "without reading tier 2"),  # damaged copy
    ({0: None, 1: None}, {12}, {}, {}, "expected 12"),  # a silent fresh start
    ({}, {12}, {}, {}, "no rank"),
])
def test_resume_fails(chosen: dict[int, Any], acceptable: set[Any], t2: dict[int, int],
                      lacking: dict[int, set[int]], word: str) -> None:
    v = cv.resume_verdict(chosen, acceptable, tier2_bytes=t2, lacking=lacking,
                          node_of=NODE_OF)
    assert not v.ok and word in v.detail


def _launch(i: int, restored: int | None, committed: bool, end: str,
            excused: str | None = None) -> cv.Launch:
    return cv.Launch(index=i, restored=restored, committed=committed, end=end, final_step=99,
                     excused=excused)


def test_crash_loop_passes_when_every_start_commits() -> None:
    ok = [_launch(0, None, True, "fault"), _launch(1, 11, True, "fault"),
          _launch(2, 20, True, "running"), _launch(3, 99, False, "finished"),
          _launch(4, 30, False, "crash", excused="tier 2 was down and a node needed it")]
    assert cv.crash_loop_verdict(ok).ok


@pytest.mark.parametrize("launch, word", [
    (_launch(1, 11, False, "crash"), "without committing"),  # restarted, died again
    (_launch(1, 11, True, "crash"), "on its own"),  # died without a fault
    (_launch(1, 11, False, "fault"), "committed no new step"),
    (_launch(1, 11, False, "running"), "committed no new step"),  # hung after restoring
])
def test_crash_loop_fails(launch: cv.Launch, word: str) -> None:
    v = cv.crash_loop_verdict([_launch(0, None, True, "fault"), launch])
    assert not v.ok and word in v.detail


def _rows(steps: range, value: float = 3.0) -> list[dict[str, Any]]:
    out = []
    for s in steps:
        loss = value - s / 100
        out.append({"step": s, "loss": loss, "loss_hex": loss.hex()})
    return out


REF = _rows(range(10))


def test_losses_pass_bit_for_bit_across_starts() -> None:
    v = cv.losses_verdict(REF, [_rows(range(0, 6)), _rows(range(3, 10))], complete=True)
    assert v.ok and v.facts["compared"] == 13


def test_losses_fail_on_one_ulp_a_gap_or_nothing() -> None:
    bad = _rows(range(3, 10))
    nudged = math.nextafter(bad[2]["loss"], 0.0)
    bad[2].update(loss=nudged, loss_hex=nudged.hex())
    v = cv.losses_verdict(REF, [_rows(range(0, 6)), bad])
    assert not v.ok and v.facts["mismatches"][0]["step"] == 5
    gap = cv.losses_verdict(REF, [_rows(range(0, 6)), _rows(range(7, 10))], complete=True)
    assert not gap.ok and gap.facts["missing"] == [6]
    assert cv.losses_verdict(REF, [_rows(range(0, 6))]).ok  # not complete yet: fine
    assert not cv.losses_verdict(REF, [[]]).ok


def test_tier1_bound() -> None:
    assert cv.disk_verdict({0: 7, 1: 5}, 7).ok
    assert cv.disk_verdict({0: 40}, None).ok  # an unbounded backlog has no bound
    v = cv.disk_verdict({0: 8, 1: 5}, 7)
    assert not v.ok and v.facts["peaks"] == {0: 8, 1: 5} and "{0: 8}" in v.detail


def test_integrity() -> None:
    assert cv.integrity_verdict([(0, 9, True, None), (1, 9, True, None)]).ok
    v = cv.integrity_verdict([(0, 9, True, None), (1, 12, False, "__1_0.distcp CRC32C ...")])
    assert not v.ok and "node 1 step 12" in v.detail
    v = cv.integrity_verdict([(0, 9, True, None)], left_broken=[(1, 15)])
    assert not v.ok and "left in place" in v.detail


def test_retained() -> None:
    seen = {0: {3, 6, 9, 12, 15}, 1: {3, 6, 9, 12, 15}}
    now = {0: {9, 12, 15}, 1: {6, 9, 12}}
    # node 0: 3 and 6 had 3 newer; node 1: 15 was set aside by a restore
    assert cv.retained_verdict(seen, now, excused={1: {15}}, keep_last=3).ok
    v = cv.retained_verdict(seen, now, excused={}, keep_last=3)
    assert not v.ok and v.facts["lost"] == [[1, 15]]
    v = cv.retained_verdict(seen, {0: {15}, 1: {6, 9, 12}}, excused={1: {15}}, keep_last=3)
    assert not v.ok and v.facts["lost"] == [[0, 9], [0, 12]]  # only 15 is newer than 12


def test_final() -> None:
    kw: dict[str, Any] = {"final_step": 99, "tier2_steps": {93, 96, 99}, "check_ok": True,
                          "check_error": None, "leftovers": [], "finished": True}
    assert cv.final_verdict(**kw).ok
    for change, word in (({"tier2_steps": {93, 96}}, "not on tier 2"),
                         ({"tier2_steps": None}, "not on tier 2"),
                         ({"check_ok": False, "check_error": "x CRC"}, "does not verify"),
                         ({"leftovers": ["python -m tierckpt.uploader /r"]}, "left behind"),
                         ({"finished": False}, "did not finish")):
        v = cv.final_verdict(**{**kw, **change})
        assert not v.ok and word in v.detail, change


# --- summary and report ----------------------------------------------------------------------

def _cycle(i: int, kinds: list[str], violations: list[str]) -> dict[str, Any]:
    return {"index": i, "kinds": kinds, "violations": violations, "faults": [
        {"label": f"{k}@node0", "kind": k, "fired": True} for k in kinds], "resumed": [],
        "recovery_s": None, "verdicts": {v: {"ok": False, "detail": f"{v} broke"}
                                         for v in violations}}


def test_summary_counts_cycles_per_kind_and_violations_per_invariant() -> None:
    s = cv.summarize([_cycle(1, ["kill_rank", "damage"], []), _cycle(2, ["kill_rank"],
                                                                     ["resume", "losses"])])
    assert s["by_kind"] == {"kill_rank": {"cycles": [1, 2], "passed": 1, "violated": 1},
                            "damage": {"cycles": [1], "passed": 1, "violated": 0}}
    assert s["violations_by_invariant"] == {"resume": 1, "losses": 1}


def test_report_is_ok_only_when_complete_and_clean() -> None:
    plan = cv.draw_plan(0, 2, nodes=2)
    base: dict[str, Any] = dict(config={"command": ["python", "t.py"], "nnodes": 2, "nproc": 1,
                                        "steps": 100, "seed": 0, "tier2": "file:///t"},
                                catalogue={"kill_rank": {"injectable": True, "how": "x"},
                                           "clock_jump": {"injectable": False, "how": "no"}},
                                plan=plan, start=_cycle(0, [], []),
                                final=_cycle(-1, [], []), restarts=2, peaks={0: 5, 1: 6},
                                bound=7, facts={}, error=None, t0=time.time())
    cycles = [_cycle(1, ["kill_rank"], []), _cycle(2, ["damage"], [])]
    doc = build_chaos_report(cycles=cycles, **base)
    assert doc["ok"] and doc["totals"]["violations"] == 0 and doc["totals"]["tier1_peak"] == 6
    assert doc["totals"]["faults_by_kind"] == {"kill_rank": 1, "damage": 1}
    md = render_chaos_markdown(doc)
    assert "PASSED" in md and "| kill_rank | 1 | 1 | 0 |" in md and "clock_jump" in md
    bad = build_chaos_report(cycles=[cycles[0], _cycle(2, ["damage"], ["resume"])], **base)
    assert not bad["ok"] and bad["violations"] == [
        {"cycle": 2, "invariant": "resume", "detail": "resume broke"}]
    assert "VIOLATED: resume" in render_chaos_markdown(bad)
    short = build_chaos_report(cycles=cycles[:1], **base)  # a planned cycle did not run
    assert not short["ok"]
    stopped = build_chaos_report(cycles=cycles, **{**base, "error": "ran out of steps"})
    assert not stopped["ok"] and "stopped early" in render_chaos_markdown(stopped)
