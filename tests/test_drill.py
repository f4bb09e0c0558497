"""Drills: the pure verdicts with values; ``tierckpt drill`` end to end on examples/train.py
(2 ranks, real torchrun, a real SIGKILL from outside, file:// tier 2); the report schema;
``tierckpt plan --from-drill`` on the produced report; a failing job exits non-zero."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

import tierckpt.cli.drill
import tierckpt.cli.plan  # registers its command
from tests.cli._helpers import flags
from tierckpt.cli._app import app
from tierckpt.cli.demo import demo_plan
from tierckpt.drill import DrillConfig, render_markdown, run_drills
from tierckpt.drill import verdicts as vd
from tierckpt.drill.drills import _fresh_out
from tierckpt.drill.launch import agent_argv, training_argv
from tierckpt.drill.preempt import PreemptConfig
from tierckpt.drill.report import SCHEMA, timeline_marks, verdicts
from tierckpt.errors import ConfigError
from tierckpt.tier2.storage.local import LocalStorage

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"
SMALL = ["--layers", "1", "--dim", "32", "--samples", "256", "--save-every", "3",
         "--timeout", "60"]
RUNNER = CliRunner()


def _row(step: int, loss: float, *, attempt: int = 0, ws: int = 2, pos: int | None = None,
         epoch: int = 0, batch: int = 8) -> dict[str, Any]:
    r: dict[str, Any] = {"step": step, "loss": loss, "loss_hex": loss.hex(), "attempt": attempt,
                         "world_size": ws, "epoch": epoch}
    r["position"] = (step + 1) * ws * batch if pos is None else pos
    return r


# --- choose_kill -------------------------------------------------------------------------------

def test_kill_is_seeded_after_a_save_not_on_one_and_before_the_end() -> None:
    saves = [2, 5, 8, 11]
    plans = {vd.choose_kill(s, steps=12, save_steps=saves, world_size=2) for s in range(50)}
    assert {p.step for p in plans} == {3, 4, 6, 7, 9}
    assert {p.rank for p in plans} == {0, 1}
    assert vd.choose_kill(7, steps=12, save_steps=saves, world_size=2) == \
        vd.choose_kill(7, steps=12, save_steps=saves, world_size=2)


@pytest.mark.parametrize("saves, steps", [([], 20), ([8, 9], 12)])
def test_kill_without_a_usable_step_names_what_to_change(saves: list[int], steps: int) -> None:
    with pytest.raises(ConfigError, match=r"save|--steps"):
        vd.choose_kill(0, steps=steps, save_steps=saves, world_size=2)


# --- continuity --------------------------------------------------------------------------------

REF = [_row(s, 5.0 - 0.1 * s) for s in range(8)]
RESUMED = [*REF[:6], *(_row(s, 5.0 - 0.1 * s, attempt=1) for s in range(4, 8))]


def test_continuity_exact_passes_for_identical_bits() -> None:
    v = vd.continuity(REF, RESUMED, resumed_from=3)
    assert v.ok and v.mode == "exact" and v.compared == 10 and v.resumed_rows == 4
    assert v.max_abs_diff == 0.0


def test_continuity_exact_fails_on_one_ulp() -> None:
    bad = [dict(r) for r in RESUMED]
    nudged = math.nextafter(bad[-1]["loss"], 0.0)
    bad[-1].update(loss=nudged, loss_hex=nudged.hex())
    v = vd.continuity(REF, bad, resumed_from=3)
    assert not v.ok and [m["step"] for m in v.mismatches] == [7]
    assert vd.continuity(REF, bad, resumed_from=3, rtol=1e-6).ok  # the GPU mode tolerates it


def test_continuity_fails_without_a_resume_or_with_missing_steps() -> None:
    assert not vd.continuity(REF, REF[:6]).ok  # never resumed
    gap = [r for r in RESUMED if not (r["attempt"] == 1 and r["step"] == 6)]
    v = vd.continuity(REF, gap, resumed_from=3)
    assert not v.ok and v.missing == [6]
    with pytest.raises(ConfigError):
        vd.continuity(REF, RESUMED, rtol=-1.0)


# --- samples across a reshard --------------------------------------------------------------

BEFORE = [_row(s, 5.0, ws=2) for s in range(6)]  # position 16, 32, ... 96 after step 5


@pytest.mark.parametrize("ws", [1, 3])
def test_samples_continue_from_the_global_position_at_a_new_world_size(ws: int) -> None:
    after = [_row(s, 5.0, ws=ws, pos=96 + (s - 5) * ws * 8) for s in range(6, 9)]
    v = vd.sample_continuity(BEFORE, after, 5)
    assert v.ok and v.checked and v.batch_per_rank == 8, v.detail


@pytest.mark.parametrize("first_pos, word", [(96, "repeated"), (96 + 48, "skipped")])
def test_samples_repeated_or_skipped_fail(first_pos: int, word: str) -> None:
    after = [_row(6, 5.0, ws=3, pos=first_pos), _row(7, 5.0, ws=3, pos=first_pos + 24)]
    v = vd.sample_continuity(BEFORE, after, 5)
    assert not v.ok and word in v.detail


def test_samples_roll_into_the_next_epoch_and_unchecked_without_positions() -> None:
    after = [_row(6, 5.0, ws=3, pos=24, epoch=1)]
    assert vd.sample_continuity(BEFORE, after, 5).ok
    bare = [{"step": r["step"], "loss": r["loss"]} for r in BEFORE]
    v = vd.sample_continuity(bare, [{"step": 6, "loss": 1.0}], 5)
    assert v.ok and not v.checked
    assert not vd.sample_continuity(BEFORE, after, 4).ok  # restored step has no row


def test_reshard_loss_must_be_finite_and_near_the_reference() -> None:
    assert vd.reshard_loss_ok(4.0, 3.9) and vd.reshard_loss_ok(4.0, None)
    assert not vd.reshard_loss_ok(4.85, 3.9)  # as if the weights had not been loaded
    assert not vd.reshard_loss_ok(float("nan"), 3.9) and not vd.reshard_loss_ok(None, 3.9)


# --- R and its parts ---------------------------------------------------------------------------

def test_restart_parts_take_the_slowest_rank_per_milestone() -> None:
    kill = 100.0
    events = [
        {"event": "save_committed", "t": 90.0, "rank": 0},
        {"event": "process_start", "t": 103.0, "rank": 0, "process_started_at": 101.0},
        {"event": "process_start", "t": 103.5, "rank": 1, "process_started_at": 101.5},
        {"event": "pg_ready", "t": 104.0, "rank": 0}, {"event": "pg_ready", "t": 104.5, "rank": 1},
        {"event": "checkpoint_chosen", "t": 106.0, "rank": 0, "step": 8},
        {"event": "state_loaded", "t": 107.0, "rank": 1},
        {"event": "first_step", "t": 107.25, "rank": 0},
        {"event": "first_step", "t": 107.5, "rank": 1},
    ]
    out = vd.restart_parts(events, kill)
    assert out is not None
    assert out["R_s"] == 7.5 and out["resumed_from_step"] == 8
    assert out["parts"] == {"respawn_s": 1.5, "startup_s": 2.0, "pg_init_s": 1.0,
                            "setup_and_choose_s": 1.5, "load_s": 1.0, "first_step_s": 0.5}
    assert sum(out["parts"].values()) == out["R_s"]
    assert vd.restart_parts(events[:-2], kill) is None


def test_a_save_the_kill_interrupted_is_named() -> None:
    events = [
        {"event": "save_staged", "t": 80.0, "step": 7}, {"event": "save_committed", "t": 81.0,
                                                          "step": 7},
        {"event": "save_staged", "t": 95.0, "step": 11},  # writing when the rank died
        {"event": "save_staged", "t": 96.0, "step": 12}, {"event": "save_failed", "t": 97.0,
                                                           "step": 12},
        {"event": "save_committed", "t": 120.0, "step": 11},  # after the failure: not counted
    ]
    assert vd.unfinished_saves(events, 100.0) == [11]
    assert vd.unfinished_saves(events, 90.0) == []


# --- launch, config, report pieces -------------------------------------------------------------

def test_agent_argv_runs_scripts_modules_and_other_programs() -> None:
    a = agent_argv(["python", "train.py", "--x"], nproc=2, nnodes=1, node_rank=0,
                   max_restarts=1, port=1, run_id="r")
    assert a[-2:] == ["train.py", "--x"] and "--standalone" in a and "--max-restarts=1" in a
    m = agent_argv(["python3", "-m", "pkg.train"], nproc=1, nnodes=2, node_rank=1,
                   max_restarts=0, port=29999, run_id="r")
    assert m[-2:] == ["-m", "pkg.train"] and "--rdzv-endpoint=127.0.0.1:29999" in m
    assert agent_argv(["./train"], nproc=1, nnodes=1, node_rank=0, max_restarts=0, port=1,
                      run_id="r")[-2:] == ["--no-python", "./train"]
    with pytest.raises(ConfigError, match="training command"):
        agent_argv([], nproc=1, nnodes=1, node_rank=0, max_restarts=0, port=1, run_id="r")
    t = training_argv(["p"], tier1=Path("/a"), losses=Path("/l"), steps=5, tier2="file:///t")
    assert t == ["p", "--tier1", "/a", "--losses", "/l", "--steps", "5", "--tier2", "file:///t"]


def test_drill_config_validates_and_defaults_tier2(tmp_path: Path) -> None:
    cfg = DrillConfig(command=("python", "t.py"), out=tmp_path)
    assert cfg.tier2 == f"file://{tmp_path / 'tier2'}" and cfg.world_size == 2
    for bad in ({"command": ()}, {"steps": 3}, {"nproc": 0}, {"reshard_sizes": (0,)},
                {"rtol": -1.0}):
        with pytest.raises(ConfigError):
            DrillConfig(**{"command": ("python", "t.py"), **bad})  # type: ignore[arg-type]


def test_a_tier2_that_already_holds_checkpoints_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t2").mkdir()  # a file:// tier 2 must exist: opening one never creates it
    with LocalStorage(tmp_path / "t2") as store:
        store.put_bytes("step-00000004/COMPLETE", b"x")
    cfg = DrillConfig(command=("python", "t.py"), out=tmp_path / "out",
                      tier2=f"file://{tmp_path / 't2'}")
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run_drills(cfg)


@pytest.mark.parametrize("make", [DrillConfig, PreemptConfig])
def test_the_resume_and_preemption_drills_start_from_a_fresh_out(tmp_path: Path,
                                                                 make: Any) -> None:
    """One preparation for both: ``<out>/runs`` emptied, the default tier 2 started empty,
    a tier 2 that holds checkpoints refused."""
    out = tmp_path / "out"
    (out / "runs" / "kill" / "tier1").mkdir(parents=True)  # a previous drill's leftovers
    (out / "tier2" / "step-00000001").mkdir(parents=True)
    (out / "tier2" / "step-00000001" / "COMPLETE").write_bytes(b"x")
    cfg = make(command=("python", "t.py"), out=out)
    assert _fresh_out(cfg) == cfg.tier2 == f"file://{out / 'tier2'}"
    assert not (out / "runs").exists() and list((out / "tier2").iterdir()) == []
    (tmp_path / "t2").mkdir()
    with LocalStorage(tmp_path / "t2") as store:
        store.put_bytes("step-00000004/COMPLETE", b"x")
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        _fresh_out(make(command=("python", "t.py"), out=out, tier2=f"file://{tmp_path / 't2'}"))


def test_the_default_tier2_is_created_empty_by_the_drill(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The drill owns ``<out>/tier2`` (opening a file:// tier 2 never creates it): it is
    emptied and created before the first job. The reference run is replaced by a probe
    that looks at tier 2 the way the jobs would (running real jobs is the end-to-end test's
    business) and then fails, so no job is launched."""
    import tierckpt.drill.drills as drills
    from tierckpt.tier2.catalog import Tier2Catalog
    from tierckpt.tier2.storage import open_storage

    out = tmp_path / "out"
    (out / "tier2" / "step-00000001").mkdir(parents=True)  # a previous drill's leftovers
    (out / "tier2" / "step-00000001" / "COMPLETE").write_bytes(b"x")
    seen: dict[str, Any] = {}

    def probe(cfg: DrillConfig, runs: list[Any]) -> dict[str, Any]:
        with open_storage(cfg.tier2 or "") as st:
            seen["steps"] = Tier2Catalog(st).complete_steps()
        return {"ok": False, "error": "probe only"}

    monkeypatch.setattr(drills, "_reference", probe)
    doc = run_drills(DrillConfig(command=("python", "t.py"), out=out))
    assert seen == {"steps": []} and (out / "tier2").is_dir()
    assert doc["ok"] is False
    with pytest.raises(ConfigError, match="--tier2"):
        DrillConfig(command=("python", "t.py"), out=out, tier2="s3://b:9000/p")


def test_verdicts_and_marks() -> None:
    assert verdicts({"kill": {"ok": True}, "continuity": {"ok": False}}) == {
        "kill": True, "continuity": False, "reshard": False, "tier2": False}
    marks = timeline_marks([{"event": "save_committed", "t": 12.0, "rank": 1, "step": 3},
                            {"event": "save_committed", "t": 12.0, "rank": 0, "step": 3},
                            {"event": "upload_verified", "t": 13.0, "rank": 0},
                            {"event": "failure_detected", "t": 14.0, "rank": 1}], 10.0)
    assert marks == [{"kind": "save", "t_s": 2.0, "rank": 0, "step": 3},
                     {"kind": "kill", "t_s": 4.0, "rank": 1, "step": None}]


def test_demo_finds_the_reference_trainer() -> None:
    """make demo runs examples/train.py from the checkout (found relative to cli/demo.py)."""
    from tierckpt.cli import demo

    assert demo.EXAMPLE.resolve() == EXAMPLE.resolve() and demo.EXAMPLE.is_file()


def test_demo_plan_uses_measured_c_w_r_for_64_nodes_at_32_days() -> None:
    p = demo_plan({"C_s": 2.0, "W_s": 1.0, "R_s": 30.0})
    assert p is not None and p.M == 32 * 86400 / 64
    assert p.interval_s == pytest.approx(math.sqrt(2 * 2.0 * 12 * 3600))
    assert p.R == 30.0 and demo_plan({"C_s": None}) is None


# --- end to end --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drilled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("drill")
    result = RUNNER.invoke(app, ["drill", "--steps", "10", "--seed", "3", "--out", str(out),
                                 "--json", "--", sys.executable, str(EXAMPLE), *SMALL],
                           catch_exceptions=False)
    return out, result


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test pays for the module's drill (~2 min)
def test_drill_end_to_end_passes_every_verdict(drilled: tuple[Path, Any]) -> None:
    out, result = drilled
    doc = json.loads((out / "drill-report.json").read_text())
    assert result.exit_code == 0, json.dumps(doc["drills"], indent=1)[-6000:]
    assert doc["ok"] and doc["verdicts"] == {"kill": True, "continuity": True, "reshard": True,
                                             "tier2": True}
    d = doc["drills"]
    kill = d["kill"]
    assert kill["kill"]["planned_step"] not in d["reference"]["save_steps"]
    assert kill["resumed_from_step"] in d["reference"]["save_steps"]
    assert kill["resumed_from_step"] < kill["kill"]["after_step"]
    cont = d["continuity"]
    assert cont["mode"] == "exact" and cont["mismatches"] == [] and cont["resumed_rows"] > 0
    runs = {r["world_size"]: r for r in d["reshard"]["runs"]}
    assert sorted(runs) == [1, 3]
    for w, r in runs.items():
        assert r["loaded"] and r["restore"]["saved_world_size"] == 2
        assert r["restore"]["world_size"] == w and r["samples"]["checked"]
        assert r["loss_ok"] and r["steps_trained"] >= 2
    t2 = d["tier2"]
    assert t2["restore"]["source"] == "tier2" and t2["tier2_bytes"] > 0
    assert t2["restore"]["step"] == max(t2["remote_steps"])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test pays for the module's drill (~2 min)
def test_drill_report_schema(drilled: tuple[Path, Any]) -> None:
    out, result = drilled
    doc = json.loads((out / "drill-report.json").read_text())
    assert json.loads(result.stdout) == doc  # --json: stdout is the document alone
    assert doc["schema"] == SCHEMA
    assert {"schema", "tierckpt_version", "torch_version", "created_unix", "duration_s",
            "config", "measured", "restart", "bytes", "tier2_restore_s", "verdicts", "ok",
            "drills", "runs", "files"} <= set(doc)
    m = doc["measured"]
    assert set(m) == {"C_s", "W_s", "R_s"} and all(m[k] > 0 for k in m)
    r = doc["restart"]
    assert r["R_s"] == m["R_s"]
    assert set(r["parts"]) == {"respawn_s", "startup_s", "pg_init_s", "setup_and_choose_s",
                               "load_s", "first_step_s"}
    assert sum(v for v in r["parts"].values() if v) == pytest.approx(r["R_s"])
    assert doc["bytes"]["checkpoint"] > 0 and doc["bytes"]["tier2_restore"] > 0
    names = [run["name"] for run in doc["runs"]]
    assert names == ["reference", "kill", "reshard-w1", "reshard-w3", "tier2"]
    kinds = {mk["kind"] for run in doc["runs"] for mk in run["marks"]}
    assert {"save", "kill", "start", "restored", "first step"} <= kinds
    assert Path(doc["files"]["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = Path(doc["files"]["md"]).read_text()
    assert md == render_markdown(doc) and "PASSED" in md


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test pays for the module's drill (~2 min)
def test_plan_from_drill_uses_the_measured_c_and_r(drilled: tuple[Path, Any]) -> None:
    out, _ = drilled
    doc = json.loads((out / "drill-report.json").read_text())
    res = RUNNER.invoke(app, ["plan", "--from-drill", str(out / "drill-report.json"),
                              "--node-mtbf", "32d", "--nodes", "64", "--json"],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["inputs"]["C_s"] == doc["measured"]["C_s"]
    assert plan["inputs"]["R_s"] == doc["measured"]["R_s"]
    assert plan["interval_s"] == pytest.approx(
        math.sqrt(2 * doc["measured"]["C_s"] * 32 * 86400 / 64))


@pytest.mark.slow
def test_a_failing_training_command_exits_non_zero(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys\nsys.exit(3)\n")
    res = RUNNER.invoke(app, ["drill", "--nproc", "1", "--steps", "6", "--out",
                              str(tmp_path / "out"), "--", sys.executable, str(script)],
                        catch_exceptions=False)
    assert res.exit_code == tierckpt.cli.drill.EXIT_FAILED
    assert "FAIL" in res.stdout  # the summary table
    doc = json.loads((tmp_path / "out" / "drill-report.json").read_text())
    assert not doc["ok"] and "reference run failed" in doc["drills"]["reference"]["error"]
    assert not any(doc["verdicts"].values())


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("drill") == {"--nproc", "--nnodes", "--steps", "--seed", "--tier2", "--out",
                              "--rtol", "--json", "--chaos", "--tier0", "--preempt",
                              "--preempt-rank", "--kinds", "--heal", "--dedup", "--etcd",
                              "command"}


def test_drill_without_a_command_is_a_usage_error() -> None:
    res = RUNNER.invoke(app, ["drill", "--steps", "10"])
    assert res.exit_code == 2


def test_the_live_view_shows_any_stage_state_as_text() -> None:
    # a state without a style once rendered as "[]done[/]", which rich refused (the heal
    # drills report "done")
    con = Console(record=True, width=120)
    with tierckpt.cli.drill.live_progress(con, ("reference", "heal")) as progress:
        progress("reference", "done", "exit 0 [1/2]")
        progress("heal", "no such state", "")
    text = con.export_text()
    assert "done" in text and "exit 0 [1/2]" in text and "no such state" in text


def test_etcd_belongs_to_the_node_drill_only() -> None:
    res = RUNNER.invoke(app, ["drill", "--etcd", "etcd://h:1", "--", "python", "t.py"])
    assert res.exit_code == 2 and "--etcd is for the node-loss heal drill" in res.output
