"""SIGKILL of the coordinator (rank 0) or of another rank in a 2-rank gloo job, at a
chosen syscall of the save (F3, F2 across ranks). (Kills mid-shard are covered by the
single-process sweep for the coordinator and, for another rank, by
``tests/test_manager_dist.py::test_sigkill_during_background_write_leaves_no_complete``.)

The killed rank dies at the N-th ``write`` (a shard), ``rename`` (#2: publishing the
directory) or ``link`` (#1: ``COMPLETE``) after step 1 is committed; the survivor must fail
loudly (:class:`SaveError`, within the collective timeout, not a hang), step 1 must be
intact, and a fresh 2-rank job must agree on and restore the newest step complete in
every tier-1 root. With node-local roots, a kill of rank 1 at its ``COMPLETE`` can leave
step 2 complete in rank 0's root only: the ranks must still agree on step 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._launch import read_jsonl
from tests._require import require
from tests.faults import _sweep
from tests.faults._oracle import TALLY, check_root, newest_valid
from tierckpt._ports import free_port

JOB = Path(__file__).with_name("rank_kill_job.py")
REPO = Path(__file__).resolve().parents[2]



@pytest.fixture(autouse=True)
def _needs_strace() -> None:
    require(_sweep.strace_usable(), "needs strace (apt-get install strace) allowed to attach "
            "(root)")



def _launch(*args: str, timeout: float = 180) -> list[int]:
    """Start both ranks as plain processes; return their exit codes."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
        procs.append(subprocess.Popen([sys.executable, str(JOB), *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    codes = []
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        codes.append(p.returncode)
    return codes


CASES = [  # (killed rank, syscall, N, node-local roots)
    (0, "rename", 2, True),    # coordinator, publishing rename (commit window)
    (1, "link", 1, True),      # other rank, its domain's COMPLETE: domains disagree
]


@pytest.mark.slow
@pytest.mark.parametrize("rank, syscall, n, node_local", CASES,
                         ids=[f"rank{r}-{s}{n}-{'local' if nl else 'shared'}"
                              for r, s, n, nl in CASES])
def test_rank_killed_mid_save(tmp_path: Path, rank: int, syscall: str, n: int,
                              node_local: bool) -> None:
    tier1, out = tmp_path / "tier1", tmp_path / "out"
    out.mkdir()
    local = ["--node-local"] if node_local else []
    codes = _launch("--tier1", str(tier1), "--out", str(out), "--phase", "kill",
                    "--kill-rank", str(rank), "--syscall", syscall, "--when", str(n), *local)
    survivor = 1 - rank
    assert codes[rank] == -9, codes  # really killed by the injected SIGKILL
    report = json.loads((out / f"rank{survivor}.json").read_text())
    assert codes[survivor] == 3 and report["error"], (codes, report)  # loud, not a hang
    roots = [tier1 / f"node{r}" for r in range(2)] if node_local else [tier1]
    lost = 0
    for r, root in enumerate(roots):
        before = {int(k): v for k, v in
                  json.loads((out / f"snap{r if node_local else 0}.json").read_text()).items()}
        kw = {"domain": (r,), "world_size": 2} if node_local else {}
        problems = check_root(root, before, **kw)  # type: ignore[arg-type]
        lost += sum("disappeared" in p or "changed" in p for p in problems)
        assert problems == [], problems
    if syscall == "link":  # rank 0 finished its own domain's commit: the roots disagree
        assert newest_valid(roots[0], domain=(0,), world_size=2) == 2
    agreed = min(newest_valid(root, **({"domain": (r,), "world_size": 2} if node_local
                                       else {})) or -1  # type: ignore[arg-type]
                 for r, root in enumerate(roots))  # the newest step complete everywhere
    for f in out.glob("rank*.json"):
        f.unlink()
    codes = _launch("--tier1", str(tier1), "--out", str(out), "--phase", "restore", *local)
    assert codes == [0, 0], codes
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [{"step": agreed, "weight": float(agreed)}] * 2, (results, agreed)
    TALLY.add(f"SIGKILL rank {rank} ({'coordinator' if rank == 0 else 'non-coordinator'})",
              lost=lost)
    print(f"\nkilled rank {rank} at {syscall} #{n}: survivor: {report['error'][:100]!r}; "
          f"restored step {agreed} on both ranks")


@pytest.mark.slow
def test_enospc_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """F9 across ranks: rank 1's shard write gets ENOSPC; both ranks record the failure
    (``save_failed``), nothing of step 2 is committed anywhere, and with
    ``on_save_error="continue"`` both go on to commit step 3."""
    tier1, out = tmp_path / "tier1", tmp_path / "out"
    out.mkdir()
    codes = _launch("--tier1", str(tier1), "--out", str(out), "--phase", "enospc",
                    "--kill-rank", "1", "--syscall", "write", "--when", "1")
    assert codes == [0, 0], codes
    evs = read_jsonl(tier1 / "events.jsonl")
    failed = {e["rank"]: e["error"] for e in evs if e["event"] == "save_failed"}
    assert sorted(failed) == [0, 1], failed  # loud on every rank
    assert "No space left on device" in failed[1]
    # every rank says the same one line (which tier, which path), not DCP's traceback
    assert all(f"tier1 is full: {tier1} has" in failed[r] for r in (0, 1)), failed
    committed_by = {(e["rank"], e["step"]) for e in evs if e["event"] == "save_committed"}
    assert committed_by == {(r, s) for r in (0, 1) for s in (1, 3)}
    assert not (tier1 / "step-00000002").exists()
    assert newest_valid(tier1) == 3
    TALLY.add("ENOSPC on one of 2 ranks")
