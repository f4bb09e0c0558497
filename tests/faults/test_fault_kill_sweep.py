"""SIGKILL at every phase of a save, enumerated from a traced clean save (F1, F2, F5-lite).

A fork server (``zygote.py``) runs one single-process save of step 3 per trial into a copy
of a root that already holds committed steps 1 and 2 (``keep_last=2``, so a successful save
also deletes step 1: retention is swept too). strace attaches before the manager opens the
root and injects SIGKILL at the N-th call of one file-system syscall (``openat``, ``write``,
``fsync``, ``mkdir``, ``rename``, ``link``, ``unlink``, ``unlinkat``, ``rmdir``): every N up
to the count seen in a traced clean save, or for ``write`` (about 200 calls) the first and
last write of every file plus an even stride. After each trial the oracle must hold:
every COMPLETE directory verifies in full, no committed checkpoint vanished or changed
(beyond what retention may delete once step 3 is complete), and a fresh manager restores
exactly the newest valid step, with the weights of that step.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._require import require
from tests.faults import _sweep
from tests.faults._oracle import (
    TALLY,
    check_root,
    newest_valid,
    restore_step,
    save_steps,
    snapshot,
)
from tierckpt.format import layout


@pytest.fixture(autouse=True)
def _needs_strace() -> None:
    require(_sweep.strace_usable(), "needs strace (apt-get install strace) allowed to attach "
            "(root)")

KEEP = 2
WRITE_STRIDE = 24  # evenly spaced write kills on top of the per-file first/last ones


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_sweep.Zygote]:
    z = _sweep.Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template") / "tier1"
    save_steps(root, [1, 2], keep_last=KEEP)
    return root


def _fresh(template: Path, base: Path, name: str) -> Path:
    root = base / name
    shutil.copytree(template, root)
    return root


@pytest.mark.slow
def test_clean_traced_save_commits(zygote: _sweep.Zygote, template: Path,
                                   tmp_path: Path) -> None:
    root = _fresh(template, tmp_path, "clean")
    log = tmp_path / "trace.log"
    status = zygote.trial(root, 3, KEEP, ["-y", "-o", str(log), "-e",
                                           "trace=" + ",".join(_sweep.SYSCALLS)])
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    calls = _sweep.per_thread_calls(log)
    # the commit protocol's own calls are all visible to the sweep
    assert calls["rename"] and calls["link"] and calls["fsync"]
    assert any(layout.COMPLETE in t for t in calls["link"])  # the marker
    assert restore_step(root) == (3, 3.0)
    ops = _sweep.fs_ops(log)
    problems = durability_order(ops, root, 3)
    assert problems == [], problems
    # the audit itself catches a missing fsync (so a library regression would fail here)
    no_root_sync = [op for op in ops if op != ("fsync", (str(root),))]
    assert any("root not fsync'd" in p for p in durability_order(no_root_sync, root, 3))
    no_shard_sync = [op for op in ops if not (op[0] == "fsync" and op[1]
                                              and op[1][0].endswith(".distcp"))]
    assert any(".distcp is not fsync'd" in p for p in durability_order(no_shard_sync, root, 3))
    TALLY.add("fsync ordering audit (power loss)", fired=True)


def durability_order(ops: list[tuple[str, tuple[str, ...]]], root: Path,
                     step: int) -> list[str]:
    """Audit a traced save for what a power cut (un-fsync'd data and names lost) would
    break (ALICE-style, from the syscall order): every file of the checkpoint is fsync'd
    after its last write and before COMPLETE is linked; the tmp directory is fsync'd after
    its last entry was made and before it is renamed; the root is fsync'd between the
    rename and the marker; the checkpoint directory is fsync'd after the marker."""
    final = str(root / layout.step_dirname(step))
    tmp_prefix = f"{final}.tmp-"
    tmp = next((p[0] for n, p in ops if n == "mkdir" and p and p[0].startswith(tmp_prefix)),
               None)
    if tmp is None:
        return ["no tmp directory was made"]

    def norm(path: str) -> str:
        return final + path[len(tmp):] if path.startswith(tmp) else path

    def index(name: str, paths: tuple[str, ...]) -> int:
        return next(i for i, op in enumerate(ops) if op == (name, paths))

    marker = index("link", next(p for n, p in ops
                                if n == "link" and p[1:] == (f"{final}/{layout.COMPLETE}",)))
    publish = index("rename", (tmp, final))
    problems = []
    last_write: dict[str, int] = {}
    fsyncs: dict[str, list[int]] = {}
    last_entry = -1
    for i, (name, paths) in enumerate(ops):
        if not paths:
            continue
        p = norm(paths[0])
        if name == "write" and p.startswith(final + "/"):
            last_write[p] = i
        elif name in ("fsync", "fdatasync"):
            fsyncs.setdefault(p, []).append(i)
        elif name in ("openat", "rename", "link", "unlink") and i < publish and \
                norm(paths[-1]).startswith(final + "/"):
            last_entry = i
    for p, w in sorted(last_write.items()):
        if not any(w < f < marker for f in fsyncs.get(p, [])):
            problems.append(f"{p} is not fsync'd between its last write and COMPLETE")
    if not any(last_entry < f < publish for f in fsyncs.get(final, [])):
        problems.append("tmp directory not fsync'd after its last entry, before the rename")
    if not any(publish < f < marker for f in fsyncs.get(str(root), [])):
        problems.append("root not fsync'd between the publishing rename and COMPLETE")
    if not any(f > marker for f in fsyncs.get(final, [])):
        problems.append("checkpoint directory not fsync'd after COMPLETE was linked")
    return problems


@pytest.mark.slow
def test_sigkill_at_every_syscall_of_a_save(zygote: _sweep.Zygote, template: Path,
                                            tmp_path: Path) -> None:
    log = tmp_path / "trace.log"
    zygote.trial(_fresh(template, tmp_path, "probe"), 3, KEEP,
                 ["-y", "-o", str(log), "-e", "trace=" + ",".join(_sweep.SYSCALLS)])
    calls = _sweep.per_thread_calls(log)
    points = list(_sweep.kill_points(calls, cap=WRITE_STRIDE))
    before = snapshot(template)
    failures: list[str] = []
    outcomes: dict[int, int] = {}
    fired = 0
    for i, (name, n, target) in enumerate(points):
        root = _fresh(template, tmp_path, f"t{i}")
        status = zygote.trial(root, 3, KEEP, ["-e", f"trace={name}",
                                               "-e", f"inject={name}:signal=KILL:when={n}"])
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        where = f"SIGKILL at {name} #{n} ({os.path.basename(target)})"
        fired += killed
        if not killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            failures.append(f"{where}: child ended with status {status}")
        problems = check_root(root, before, retained=KEEP)
        newest = newest_valid(root)
        if not killed and newest != 3:
            problems.append(f"save finished but newest valid is {newest}")
        if newest not in (2, 3):
            problems.append(f"newest valid step is {newest}")
        chosen, value = restore_step(root)
        if (chosen, value) != (newest, None if newest is None else float(newest)):
            problems.append(f"restore chose {chosen} (weights {value}), oracle says {newest}")
        leftovers = [n for n in os.listdir(root)
                     if layout.parse_tmp_dirname(n) or layout.is_deleting_dirname(n)]
        if leftovers:
            problems.append(f"start-up cleanup left {leftovers}")
        lost = sum("disappeared" in p or "changed" in p for p in problems)
        TALLY.add(f"SIGKILL at {name}", fired=killed, lost=lost)
        outcomes[newest or -1] = outcomes.get(newest or -1, 0) + 1
        failures += [f"{where}: {p}" for p in problems]
        shutil.rmtree(root)
    print(f"\nkill sweep: {len(points)} kill points, {fired} fired; resumed step -> count "
          f"{outcomes}")
    assert not failures, "\n".join(failures)
    assert fired >= len(points) * 0.9  # the sweep really killed the save at those points
    assert outcomes.get(2) and outcomes.get(3)  # kills landed before and after the commit
