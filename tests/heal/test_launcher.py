"""The heal launcher's supervision with small real workers (no training): the environment
it gives, what ends a job, when a death is a full restart, and its pre-warmed spares."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tierckpt.errors import ConfigError
from tierckpt.heal.launcher import HealLaunch, HealLauncher
from tierckpt.heal.spares import SparePool, spare_command
from tierckpt.preempt.config import EXIT_PREEMPTED


def _worker(tmp: Path, body: str) -> list[str]:
    """A worker script: it appends its environment to ``env.jsonl``, then runs ``body``."""
    script = tmp / "worker.py"
    script.write_text(textwrap.dedent('''
        import json, os, sys, time
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                "TIERCKPT_HEAL_ID", "TIERCKPT_HEAL_GEN")
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps({k: os.environ.get(k) for k in keys}) + "\\n")
        rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    ''') + textwrap.dedent(body))
    return [sys.executable, str(script), str(tmp / "env.jsonl")]


def _envs(tmp: Path) -> list[dict[str, str]]:
    return [json.loads(x) for x in (tmp / "env.jsonl").read_text().splitlines()]


def _run(tmp: Path, body: str, **cfg: object) -> tuple[int, list[str]]:
    lines: list[str] = []
    config = HealLaunch(**{"nproc": 2, "spares": 0, **cfg})  # type: ignore[arg-type]
    status = HealLauncher(_worker(tmp, body), config, say=lines.append).run()
    return status, lines


def test_workers_get_torchruns_environment_and_the_heal_contract(tmp_path: Path) -> None:
    status, _ = _run(tmp_path, "sys.exit(0)")
    assert status == 0
    envs = sorted(_envs(tmp_path), key=lambda e: e["RANK"])
    assert [e["RANK"] for e in envs] == ["0", "1"] and all(
        e["WORLD_SIZE"] == "2" and e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"]
        and e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["TORCHELASTIC_USE_AGENT_STORE"] ==
        "True" and e["TIERCKPT_HEAL_GEN"] == "0" for e in envs)
    assert envs[0]["TIERCKPT_HEAL_ID"] == envs[1]["TIERCKPT_HEAL_ID"]


def test_a_death_before_the_state_loaded_is_a_full_restart(tmp_path: Path) -> None:
    """No rank counted ``ready``: nothing to heal from, so every worker starts again, in a new
    incarnation (a fresh heal id), as torchrun would."""
    # rank 1 dies once rank 0 of its incarnation wrote its environment (else, on a loaded
    # machine, rank 0 could be killed before it started and leave one record, not two)
    status, lines = _run(tmp_path, "if rank == 1 and restart == 0:\n"
                         "    while open(sys.argv[1]).read().count('RANK\": \"0') < 1:\n"
                         "        time.sleep(0.01)\n"
                         "    sys.exit(1)\n"
                         "time.sleep(2 if rank == 0 else 0)\n")
    assert status == 0
    assert any("never loaded its state on every rank" in x for x in lines), lines
    envs = _envs(tmp_path)
    assert sorted(e["TORCHELASTIC_RESTART_COUNT"] for e in envs) == ["0", "0", "1", "1"]
    assert len({e["TIERCKPT_HEAL_ID"] for e in envs}) == 2


def test_restarts_are_bounded_and_the_status_is_the_jobs(tmp_path: Path) -> None:
    status, lines = _run(tmp_path, "sys.exit(3 if rank == 0 else 0)", max_restarts=1)
    assert status != 0
    assert any("giving up after 1 full restarts" in x for x in lines), lines


def test_a_preempted_worker_ends_the_job_with_75(tmp_path: Path) -> None:
    status, _ = _run(tmp_path, f"time.sleep(0.3 * rank); sys.exit({EXIT_PREEMPTED})")
    assert status == EXIT_PREEMPTED
    assert len(_envs(tmp_path)) == 2  # not restarted


def test_heal_off_is_torchrun_behaviour(tmp_path: Path) -> None:
    status, lines = _run(tmp_path, "sys.exit(1 if rank == 1 and restart == 0 else 0)",
                         heal=False)
    assert status == 0 and any("healing is off" in x for x in lines), lines


@pytest.mark.parametrize("field, value", [("nproc", 0), ("max_heals", -1), ("spares", 1.5),
                                          ("timeout_s", 0), ("settle_s", "1")])
def test_bad_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"HealLaunch.{field}"):
        HealLaunch(**{"nproc": 2, field: value})  # type: ignore[arg-type]


def test_an_empty_command_is_refused() -> None:
    with pytest.raises(ConfigError, match="after --"):
        HealLauncher([], HealLaunch(nproc=1))


def test_only_a_python_command_can_use_a_spare() -> None:
    assert spare_command(["python3", "train.py", "--x"]) == [
        "python3", "-m", "tierckpt.heal.spares", "train.py", "--x"]
    assert spare_command(["/usr/bin/python3.11", "-m", "pkg"]) == [
        "/usr/bin/python3.11", "-m", "tierckpt.heal.spares", "-m", "pkg"]
    assert spare_command(["./train.sh"]) is None and spare_command(["python"]) is None


def test_a_spare_runs_the_script_in_the_environment_it_is_given(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    out = tmp_path / "out.json"
    script.write_text("import json, os, sys\n"
                      "json.dump({'argv': sys.argv, 'rank': os.environ['RANK'], "
                      "'name': __name__, 'torch': 'torch' in sys.modules, "
                      "'lazy': [m in sys.modules for m in ('torch._dynamo', "
                      "'tierckpt.manager', 'tierckpt.restore.restorer')]}, "
                      f"open({str(out)!r}, 'w'))\n")
    pool = SparePool([sys.executable, str(script), "--flag"], 1)
    try:
        deadline = time.monotonic() + 120
        proc = None
        while proc is None:
            assert time.monotonic() < deadline, "the spare never became ready"
            proc = pool.take({"RANK": "3"})
            time.sleep(0.05)
        assert proc.wait(60) == 0
        assert pool.waiting == 0  # not replaced while a heal may still run: fill() does it
        pool.fill()
        assert pool.waiting == 1
    finally:
        pool.close()
    got = json.loads(out.read_text())
    assert got == {"argv": [str(script), "--flag"], "rank": "3", "name": "__main__",
                   "torch": True,  # imported before the assignment: the point of a spare
                   "lazy": [True, True, True]}  # and what a worker imports on first use


def test_cli_run_help_does_not_need_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", "import sys; from tierckpt.cli import main; "
                           "sys.argv = ['tierckpt', 'run', '--help']; main()"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--nproc-per-node" in proc.stdout
    assert "--heal" in proc.stdout


def test_a_spare_imports_what_the_script_imports_and_runs_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt.heal.spares import _preimport

    (tmp_path / "heavy_dep_for_spare.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    script = tmp_path / "job.py"
    script.write_text("import heavy_dep_for_spare\nfrom no_such_module_xyz import thing\n"
                      "raise SystemExit(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _preimport(script)  # a missing module is the script's to report; the raise never runs
    assert (tmp_path / "imported").exists()
    sys.modules.pop("heavy_dep_for_spare", None)
