"""The chaos drill's pure logic with values alone: the expected restore point, every
invariant passing and failing, the per-kind summary and the report (the seeded plan:
test_drill_chaos_plan.py)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill.chaos_report import build_chaos_report, render_chaos_markdown

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


def test_ram_restorable_is_own_ram_or_the_partners_replica_undamaged() -> None:
    assert cv.partner(0, 2) == 1 and cv.partner(1, 2) == 0 and cv.partner(2, 3) == 0
    own = {0: {12}, 1: {12}}
    held = {0: {9}, 1: {12}}  # node 1 holds node 0's 12; node 0 holds node 1's 9
    assert cv.ram_restorable(own, held, {}) == {0: {12}, 1: {9, 12}}
    assert cv.ram_restorable({0: set(), 1: {12}}, held, {}) == {0: {12}, 1: {9, 12}}  # wiped
    assert cv.ram_restorable(own, held, {0: {("own", 12)}, 1: {("replica", 12)}}) == {
        0: set(), 1: {9, 12}}  # node 0's own copy and its replica damaged
    assert cv.ram_restorable({0: set(), 1: set()}, {0: set(), 1: set()}, {}) == {0: set(),
                                                                                1: set()}


def test_expected_takes_the_newest_step_on_any_source() -> None:
    complete = {0: {6, 9}, 1: {6, 9}}  # tier 1 lags: step 12 was in RAM only
    assert cv.expected_restore(complete, {}, {6}, {0: {12}, 1: {12}}) == 12
    # the oracle the issue reported: a tier-1-only oracle would call 12 wrong
    assert cv.expected_restore(complete, {}, {6}) == 9
    # a replaced node (disk and RAM empty) restores 12 from its partner's replica
    assert cv.expected_restore({0: {6, 9}, 1: set()}, {}, {6}, {0: {12}, 1: {12}}) == 12
    # ... but not when that replica was damaged too: the newest both have is 6 on tier 2
    ram = cv.ram_restorable({0: {12}, 1: set()}, {0: {12}, 1: set()}, {0: {("replica", 12)}})
    assert cv.expected_restore({0: {6, 9}, 1: set()}, {}, {6}, ram) == 6
    # a damaged tier-1 copy does not matter while RAM holds the step intact
    assert cv.expected_restore(complete, {1: {9}}, set(), {0: {9}, 1: {9}}) == 9
    # RAM on one node only, nothing else anywhere: the library refuses
    assert cv.expected_restore({0: set(), 1: set()}, {}, set(), {0: {12}, 1: set()}) == \
        "refuse"


def test_expected_skips_a_tier2_step_whose_shard_a_node_needs_is_damaged() -> None:
    """Node 1 was wiped: it restores from tier 2 alone. Step 12's shard of node 1 is
    damaged there, so 9 is the restore point; a shard of node 0 damaged instead leaves 12
    (node 0 reads its own tier 1), and nothing left for node 1 is a refusal."""
    complete, t2 = {0: {6, 9, 12}, 1: set()}, {9, 12}
    assert cv.expected_restore(complete, {}, t2, None, {1: {12}}) == 9
    assert cv.expected_restore(complete, {}, t2, None, {0: {12}}) == 12
    assert cv.expected_restore(complete, {}, t2, None, {1: {9, 12}}) == "refuse"


def test_expected_is_refuse_when_only_some_nodes_could_restore() -> None:
    assert cv.expected_restore({0: {6, 9}, 1: set()}, {}, None) == "refuse"
    assert cv.expected_restore({0: {9}, 1: {9}}, {1: {9}}, set()) == "refuse"


# --- each invariant passes, and each can fail -----------------------------------------------

NODE_OF = {0: 0, 1: 1}


def _read(**by_source: int) -> dict[str, int]:
    return {"tier0": 0, "tier0-peer": 0, "tier1": 0, "tier2": 0, **by_source}


def test_resume_passes_for_the_expected_step_read_safely() -> None:
    local = {0: _read(tier1=500), 1: _read(tier1=500)}
    v = cv.resume_verdict({0: 12, 1: 12}, {12}, read=local, bad={}, node_of=NODE_OF)
    assert v.ok and v.name == "resume"
    v = cv.resume_verdict({0: 12, 1: 12}, {12}, read={0: _read(tier1=500),
                                                      1: _read(tier1=500, tier2=800)},
                          bad={1: {"tier1"}}, node_of=NODE_OF)
    assert v.ok  # node 1's copy was damaged and it fetched the step from tier 2
    assert cv.resume_verdict({0: None, 1: None}, {None}, read={}, bad={},
                             node_of=NODE_OF).ok  # a fresh start where nothing existed


def test_resume_judges_the_ranks_of_a_node_together() -> None:
    # one node of three ranks whose tier-1 copy was removed: rank 0 fetched the node's
    # files from tier 2 into its tier 1, and ranks 1 and 2 read that fresh copy from there
    one_node = {0: 0, 1: 0, 2: 0}
    read = {0: _read(tier1=190, tier2=700), 1: _read(tier1=190), 2: _read(tier1=186)}
    assert cv.resume_verdict({0: 8, 1: 8, 2: 8}, {8}, read=read, bad={0: {"tier1"}},
                             node_of=one_node).ok
    read[0] = _read(tier1=190)  # no rank of the node read anything but the damaged source
    v = cv.resume_verdict({0: 8, 1: 8, 2: 8}, {8}, read=read, bad={0: {"tier1"}},
                          node_of=one_node)
    assert not v.ok and "node 0's ranks restored step 8 from tier1 though" in v.detail


def test_resume_accepts_ram_and_the_partners_replica() -> None:
    # tier 1 lacked (or held a damaged) 12; both read it from RAM: a correct resume
    v = cv.resume_verdict({0: 12, 1: 12}, {12}, read={0: _read(tier0=500), 1: _read(
        tier0=500)}, bad={0: {"tier1"}, 1: {"tier1"}}, node_of=NODE_OF)
    assert v.ok
    # node 1's own RAM copy was damaged: it pulled its partner's replica into RAM
    v = cv.resume_verdict({0: 12, 1: 12}, {12}, read={0: _read(tier0=500), 1: _read(
        tier0=500, **{"tier0-peer": 500})}, bad={1: {"tier0"}}, node_of=NODE_OF)
    assert v.ok
    # ... or read tier 1
    assert cv.resume_verdict({0: 12, 1: 12}, {12}, read={0: _read(tier0=500), 1: _read(
        tier1=500)}, bad={1: {"tier0"}}, node_of=NODE_OF).ok


@pytest.mark.parametrize("chosen, acceptable, read, bad, word", [
    ({0: 9, 1: 9}, {12}, {}, {}, "expected 12"),  # an older one than the newest intact
    ({0: 12, 1: 9}, {12}, {}, {}, "different steps"),
    ({0: 12, 1: 12}, {12}, {0: _read(tier1=5), 1: _read(tier1=5)}, {1: {"tier1"}},
     "from tier1 though"),  # read the damaged tier-1 copy
    ({0: 12, 1: 12}, {12}, {0: _read(tier0=5), 1: _read(tier0=5)}, {1: {"tier0"}},
     "from tier0 though"),  # read the damaged RAM copy
    ({0: 12, 1: 12}, {12}, {0: _read(tier0=5)}, {1: {"tier1"}}, "from nowhere"),
    ({0: None, 1: None}, {12}, {}, {}, "expected 12"),  # a silent fresh start
    ({}, {12}, {}, {}, "no rank"),
])
def test_resume_fails(chosen: dict[int, Any], acceptable: set[Any],
                      read: dict[int, dict[str, int]], bad: dict[int, set[str]],
                      word: str) -> None:
    v = cv.resume_verdict(chosen, acceptable, read=read, bad=bad, node_of=NODE_OF)
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
    assert cv.tier1_bound(3, 2) == 7 and cv.tier1_bound(3, None) is None
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
    v = cv.integrity_verdict([(0, 9, True, None), ("1 RAM", 12, False, "CRC32C")])
    assert not v.ok and "node 1 RAM step 12" in v.detail  # node RAM is scrubbed too
    v = cv.integrity_verdict([], left_broken=[("0 replica", 12)])
    assert not v.ok and "left in place on node 0 replica" in v.detail


def test_integrity_reports_a_damaged_copy_no_restore_read_as_found() -> None:
    # node 1's tier-1 copy of 12 was damaged; the restore read 12 from RAM: the copy stays,
    # the scrub finds it, tier 2's copy of 12 verifies (the damaged bytes were not uploaded)
    v = cv.integrity_verdict([(0, 12, True, None)], damaged=[(1, 12, False, "CRC32C")],
                             tier2=[(12, True, None)])
    assert v.ok and "found 1 damaged" in v.detail
    assert v.facts["damaged_found"] == [[1, 12]] and v.facts["tier2_checked"] == [12]
    # a damage a single root's check cannot see (a missing shard: "elsewhere") is no error
    assert cv.integrity_verdict([], damaged=[(1, 12, True, None)]).ok
    v = cv.integrity_verdict([], damaged=[(1, 12, False, "x")], tier2=[(12, False, "CRC")])
    assert not v.ok and "tier 2's step 12 does not verify" in v.detail


def test_tier2_every_intact_step_verifies_and_every_damaged_one_fails() -> None:
    ok = cv.tier2_verdict([(9, True, None), (12, False, "crc32c mismatch")], {12},
                          orphans=2, leases=1)
    assert ok.ok and "1 damaged one(s) fail" in ok.detail and "2 orphan object(s)" in ok.detail
    assert ok.facts["orphans"] == 2 and ok.facts["leases"] == 1
    bad = cv.tier2_verdict([(9, False, "no such object"), (12, False, "x")], {12})
    assert not bad.ok and "step 9 does not verify: no such object" in bad.detail
    missed = cv.tier2_verdict([(12, True, None)], {12})
    assert not missed.ok and "verifies though the drill damaged" in missed.detail


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
