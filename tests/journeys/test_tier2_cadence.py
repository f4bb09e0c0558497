"""What a user configures for tier 2 is what reaches it: ``Tier2(url, upload_every=N)``
copies every Nth checkpoint the job commits, whatever steps its own save rule lands on, and
the final state of a clean end and of a preempted end both reach tier 2."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.journeys import _run

pytestmark = pytest.mark.slow

LOOP = """\
import torch
import tierckpt
from tierckpt import Tier2

model = torch.nn.Linear(16, 16)
opt = torch.optim.AdamW(model.parameters())
state = tierckpt.TrainState(model=model, optimizer=opt)
with tierckpt.CheckpointManager(tier1="ckpt", tier2=Tier2("{url}", upload_every={every})
                                ) as ckpt:
    restored = ckpt.restore(state)
    for step in range(restored.step + 1 if restored else 0, {steps}):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if {rule} or ckpt.should_save(step):
            ckpt.save(step, state)
        if ckpt.should_stop(step):
            break
"""


def _loop(tmp_path: Path, *, every: int, rule: str, steps: int = 60) -> tuple[str, str]:
    bucket = tmp_path / "bucket"
    bucket.mkdir(exist_ok=True)
    return LOOP.format(url=bucket.as_uri(), every=every, rule=rule, steps=steps), \
        bucket.as_uri()


def test_every_fifth_save_reaches_tier_2_under_the_readme_save_rule(tmp_path: Path) -> None:
    # the finding: saves at 9, 19, ..., 59 and upload_every=5 (was: step % 5 == 0, never met)
    code, url = _loop(tmp_path, every=5, rule="step % 10 == 9")
    _run.ok(_run.run(code, tmp_path, _run.env()), "the run")
    due = [e["step"] for e in _run.events(tmp_path / "ckpt", "upload_due")]
    assert due == [49]  # the 5th save is due for tier 2
    # 59, the final state of the clean end, is on tier 2. 49 is too when the uploader
    # copied it before close() asked for 59; else it was skipped for the newer copy (the
    # uploader skips ahead rather than fall behind): the run takes milliseconds, so which
    # one is a race, and only what cannot race is asserted.
    on_tier2 = _run.tier2_steps(url)
    assert on_tier2[0] == 59 and set(on_tier2) <= {49, 59}


def test_a_clean_end_leaves_its_final_step_on_tier_2(tmp_path: Path) -> None:
    code, url = _loop(tmp_path, every=2, rule="step % 5 == 4")
    _run.ok(_run.run(code, tmp_path, _run.env()), "the run")
    assert _run.tier2_steps(url)[0] == 59  # was 54: the last save was never due


def test_a_preempted_end_leaves_its_final_step_on_tier_2(tmp_path: Path) -> None:
    code, url = _loop(tmp_path, every=1000, rule="step % 10 == 9", steps=100_000)
    ckpt = tmp_path / "ckpt"
    env = _run.env()
    (tmp_path / "sitecustomize.py").write_text(_run.SLOW_STEP.format(s=0.02))
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    proc = _run.run(code, tmp_path, env, until=lambda: any(_run.events(ckpt, "save_committed")),
                    send=signal.SIGTERM)
    assert proc.returncode == 75, proc.stderr[-3000:]
    [stop] = [e["step"] for e in _run.events(ckpt, "preempt_stop")]
    assert _run.tier1_steps(ckpt)[0] == stop
    assert _run.tier2_steps(url)[0] == stop
