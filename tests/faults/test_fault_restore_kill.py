"""A restore killed half-way through fetching from tier 2, then retried (issue 7:
"restore killed half-way (tier 2 → tier 1 download) and retried").

Every node is gone: tier 1 is empty, tier 2 (``file://``) holds steps 1 and 2 uploaded by
the real uploader. A restore in the fork server's child fetches step 2 into tier 1; strace
kills it at the N-th ``write``/``rename``/``link``/``fsync`` of the fetch (the same
enumeration as the save sweep). After each kill, tier 1 must hold no ``COMPLETE`` over a
partial directory, and a retried restore must restore step 2 with step 2's weights.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierckpt
from tests._require import require
from tests.faults import _sweep
from tests.faults._oracle import (
    TALLY,
    check_root,
    make_state,
    restore_step,
    save_steps,
    weights_step,
)
from tierckpt import Tier2
from tierckpt.format import layout
from tierckpt.tier2.uploader import Uploader, UploaderConfig


@pytest.fixture(autouse=True)
def _needs_strace() -> None:
    require(_sweep.strace_usable(), "needs strace (apt-get install strace) allowed to attach "
            "(root)")

SYSCALLS = "openat,write,fsync,mkdir,rename,link,unlink"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_sweep.Zygote]:
    z = _sweep.Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


def _retry(root: Path, tier2: str) -> tuple[int | None, float | None]:
    st = make_state(-1)
    with tierckpt.CheckpointManager(tier1=root, tier2=Tier2(tier2, start_uploader=False),
                                    verify="full") as ck:
        info = ck.restore(st)
    return (None, None) if info is None else (info.step, weights_step(st))


@pytest.mark.slow
def test_restore_killed_mid_fetch_then_retried(zygote: _sweep.Zygote, tmp_path: Path) -> None:
    src, tier2 = tmp_path / "src", f"file://{tmp_path / 'tier2'}"
    (tmp_path / "tier2").mkdir()  # a file:// tier 2 must exist: opening one never creates it
    save_steps(src, [1, 2])
    with Uploader(UploaderConfig(tier1=src, tier2=tier2)) as up:
        assert {r.status for r in up.drain()} == {"verified"}

    def trial(name: str, strace_args: list[str]) -> tuple[Path, int]:
        root = tmp_path / name
        root.mkdir()
        result = tmp_path / f"{name}.json"
        status = zygote.trial(root, 0, 3, strace_args, action="restore", tier2=tier2,
                              result=str(result))
        return root, status

    log = tmp_path / "trace.log"
    root, status = trial("clean", ["-y", "-o", str(log), "-e", f"trace={SYSCALLS}"])
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert json.loads((tmp_path / "clean.json").read_text()) == {"step": 2}
    assert restore_step(root) == (2, 2.0)
    calls = _sweep.per_thread_calls(log)
    points = list(_sweep.kill_points(calls, cap=8))
    failures, fired = [], 0
    for i, (name, n, target) in enumerate(points):
        root, status = trial(f"t{i}", ["-e", f"trace={name}",
                                       "-e", f"inject={name}:signal=KILL:when={n}"])
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        fired += killed
        where = f"SIGKILL at {name} #{n} ({os.path.basename(target)})"
        problems = check_root(root, {})
        got = _retry(root, tier2)
        if got != (2, 2.0):
            problems.append(f"retried restore gave {got}")
        stray = [p for p in os.listdir(root) if layout.parse_tmp_dirname(p)]
        if stray:
            problems.append(f"tmp dirs left after the retry: {stray}")
        failures += [f"{where}: {p}" for p in problems]
        TALLY.add("SIGKILL during tier-2 fetch, then retry", fired=killed)
        shutil.rmtree(root)
    print(f"\nrestore kill sweep: {len(points)} kill points, {fired} fired")
    assert not failures, "\n".join(failures)
    assert fired >= len(points) * 0.8
