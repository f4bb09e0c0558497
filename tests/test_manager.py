"""CheckpointManager in one process (no process group): real files, real fsync."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt import Failures, Tier2, Writes
from tierckpt.errors import ConfigError, LockError, SaveError
from tierckpt.format import layout
from tierckpt.runtime import events


def _state(seed: int = 0, width: int = 16) -> tuple[tierckpt.TrainState, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.2), nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return tierckpt.TrainState(model=model, optimizer=opt, scheduler=sched,
                               extra={"tokens": 0}), model


def _train(state: tierckpt.TrainState, n: int) -> list[float]:
    out = []
    for _ in range(n):
        x = torch.randn(8, state.model[0].in_features)
        loss = state.model(x).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.extra["tokens"] += 8
        out.append(loss.item())
    return out


def test_fresh_start_then_exact_resume(tmp_path: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path, keep_last=2) as ck:
        assert ck.restore(st) is None
        _train(st, 3)
        h = ck.save(2, st)
        res = h.wait(30)
        assert h.staged.result(5) > 0  # the blocked seconds, once the copies landed
        assert res.step == 2 and res.path == tmp_path / "step-00000002"
        ref = _train(st, 4)
    st2, _ = _state(seed=99)  # different init and RNG: everything must come from the checkpoint
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        info = ck.restore(st2)
        assert info is not None and info.step == 2 and info.source == "tier1"
        assert info.bytes_read > 0 and not info.resharded
        assert st2.extra == {"tokens": 24}
        assert _train(st2, 4) == ref


def test_events_record_c_w_and_restore(tmp_path: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        ck.save(0, st)
        ck.save(1, st)
        ck.wait()
        ck.restore(st)
    evs = events.read_events(tmp_path / layout.EVENTS)
    kinds = [e["event"] for e in evs]
    for k in ("save_staged", "save_durable", "save_committed", "restore_done"):
        assert k in kinds
    staged = [e for e in evs if e["event"] == "save_staged"]
    assert [e["step"] for e in staged] == [0, 1]
    assert all(e["seconds"] > 0 and e["bytes"] > 0 for e in staged)
    committed = [e for e in evs if e["event"] == "save_committed"]
    assert all(e["write_seconds"] > 0 and e["bytes"] > 0 for e in committed)


def test_one_save_in_flight_records_overlap(tmp_path: Path) -> None:
    st, _ = _state(width=1024)  # ~25 MB with Adam moments: writing takes far longer than µs
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        h1 = ck.save(0, st)
        h2 = ck.save(1, st)  # must wait for h1 first
        assert h1.done()
        h2.wait()
    overlaps = [e for e in events.read_events(tmp_path / layout.EVENTS) if e["event"] == "overlap"]
    assert len(overlaps) == 1 and overlaps[0]["step"] == 0 and overlaps[0]["seconds"] >= 0


def test_retention_keeps_last_and_pinned(tmp_path: Path) -> None:
    st, _ = _state()
    (tmp_path / layout.PINS).mkdir()
    (tmp_path / layout.PINS / layout.pin_filename(1, "upload")).touch()
    with tierckpt.CheckpointManager(tier1=tmp_path, keep_last=2) as ck:
        for s in range(6):
            ck.save(s, st)
        ck.wait()
    steps = sorted(p.name for p in tmp_path.glob("step-*"))
    assert steps == ["step-00000001", "step-00000004", "step-00000005"]


def test_save_failure_surfaces_and_training_can_continue(tmp_path: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        ck.save(0, st).wait()
        # A file where the step-1 tmp directory must go: the background write fails.
        (tmp_path / layout.tmp_dirname(1, f"{ck.run_id}-1")).write_text("in the way")
        ck.save(1, st)
        with pytest.raises(SaveError, match="step 1"):
            ck.wait()
        assert not (tmp_path / "step-00000001").exists()
        assert (tmp_path / "step-00000000" / layout.COMPLETE).exists()  # previous intact
        ck.save(2, st).wait()                                            # and we go on
    assert (tmp_path / "step-00000002" / layout.COMPLETE).exists()


def test_on_save_error_continue_keeps_training(tmp_path: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path,
                                    failures=Failures(on_save_error="continue")) as ck:
        ck.save(0, st).wait()
        (tmp_path / layout.tmp_dirname(1, f"{ck.run_id}-1")).write_text("in the way")
        ck.save(1, st)
        ck.save(2, st).wait()  # no raise: logged and went on
    committed = sorted(p.name for p in tmp_path.iterdir()
                       if layout.parse_step_dirname(p.name) is not None)
    assert committed == ["step-00000000", "step-00000002"]
    failed = [e for e in events.read_events(tmp_path / layout.EVENTS)
              if e["event"] == "save_failed"]
    assert [e["step"] for e in failed] == [1]


def test_close_raises_inflight_error(tmp_path: Path) -> None:
    st, _ = _state()
    ck = tierckpt.CheckpointManager(tier1=tmp_path)
    (tmp_path / layout.tmp_dirname(0, f"{ck.run_id}-0")).write_text("x")
    ck.save(0, st)
    with pytest.raises(SaveError):
        ck.close()
    ck.close()  # idempotent
    with tierckpt.CheckpointManager(tier1=tmp_path):  # lock was released
        pass


def test_step_must_increase(tmp_path: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        ck.save(5, st).wait()
        with pytest.raises(ConfigError, match="already committed"):
            ck.save(5, st)
        with pytest.raises(ConfigError, match="steps must increase"):
            ck.save(3, st)
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck, \
            pytest.raises(ConfigError, match="already committed"):  # also across restarts
        ck.save(4, st)
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-00000005"]


def test_second_job_on_same_root_is_refused(tmp_path: Path) -> None:
    with tierckpt.CheckpointManager(tier1=tmp_path), \
            pytest.raises(LockError, match="another job"):
        tierckpt.CheckpointManager(tier1=tmp_path)


def test_startup_removes_stale_tmp_but_never_complete(tmp_path: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        ck.save(0, st).wait()
    stale = tmp_path / layout.tmp_dirname(1, "dead-1")
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    half_deleted = tmp_path / layout.deleting_dirname(0, "zz")
    half_deleted.mkdir()
    with tierckpt.CheckpointManager(tier1=tmp_path):
        assert not stale.exists() and not half_deleted.exists()
        assert (tmp_path / "step-00000000" / layout.COMPLETE).exists()


@pytest.mark.parametrize("kwargs, match", [
    ({"keep_last": 0}, "keep_last"),
    ({"verify": "bogus"}, "verify"),
    ({"writes": {"threads": 0}}, r"Writes\.threads"),
    ({"writes": {"file_mode": 0o666}}, "world-writable"),
    ({"failures": {"collective_timeout_s": -1}}, r"Failures\.collective_timeout_s"),
])
def test_bad_config_names_the_argument(tmp_path: Path, kwargs: dict, match: str) -> None:
    groups = {"writes": tierckpt.Writes, "failures": tierckpt.Failures}
    with pytest.raises(ConfigError, match=match):
        kw = {k: groups[k](**v) if k in groups else v for k, v in kwargs.items()}
        tierckpt.CheckpointManager(tier1=tmp_path, **kw)


def test_unwritable_tier1_and_missing_tier1(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not a writable directory"):
        tierckpt.CheckpointManager(tier1=blocker / "sub")
    with pytest.raises(ConfigError, match="tier1"):
        tierckpt.CheckpointManager()  # type: ignore[call-arg]


def test_trainstate_rejects_wrong_types() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="model"):
        tierckpt.TrainState(model="not a module")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="optimizer"):
        tierckpt.TrainState(model=model, optimizer=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        tierckpt.TrainState(model=model, dataloader=torch.utils.data.DataLoader([1, 2]))
    with pytest.raises(ConfigError, match="extra"):
        tierckpt.TrainState(model=model, extra={1: 2})  # type: ignore[dict-item]


def test_files_are_not_world_writable(tmp_path: Path) -> None:
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tmp_path,
                                    writes=Writes(file_mode=0o600, dir_mode=0o700)) as ck:
        ck.save(0, st).wait()
    for p in (tmp_path / "step-00000000").iterdir():
        assert os.stat(p).st_mode & 0o777 == 0o600, p
    assert os.stat(tmp_path / "step-00000000").st_mode & 0o777 == 0o700


def test_tier2_uploader_process_and_restore_from_tier2(tmp_path: Path) -> None:
    tier1, tier2 = tmp_path / "t1", f"file://{tmp_path / 't2'}"
    (tmp_path / "t2").mkdir()  # a file:// tier 2 must exist: opening one never creates it
    st, _ = _state()
    with tierckpt.CheckpointManager(tier1=tier1, tier2=Tier2(tier2, drain_s=60)) as ck:
        _train(st, 2)
        ck.save(1, st).wait()
        ref = _train(st, 3)
    assert (tmp_path / "t2" / "step-00000001" / layout.COMPLETE).exists()  # drained on close
    uploaded = [e for e in events.read_events(tier1 / layout.EVENTS)
                if e["event"] == "upload_verified"]
    assert [e["step"] for e in uploaded] == [1]
    import shutil
    shutil.rmtree(tier1)
    st2, _ = _state(seed=7)
    with tierckpt.CheckpointManager(tier1=tier1, tier2=Tier2(tier2, start_uploader=False)) as ck:
        info = ck.restore(st2)
    assert info is not None and info.step == 1 and info.source == "tier2"
    assert info.bytes_by_source["tier2"] > 0
    assert _train(st2, 3) == ref


def test_bad_tier2_url_names_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tier2"):
        tierckpt.CheckpointManager(tier1=tmp_path, tier2="ftp://x")


def _big(value: float) -> tierckpt.TrainState:
    """~128 MiB of weights: writing it takes far longer than a 10 ms wait_timeout_s."""
    model = nn.Linear(5792, 5792, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return tierckpt.TrainState(model=model)


def _weight_of(tmp: Path, src: Path, step: int) -> float:
    """The weight value of checkpoint ``step`` alone (restored from a root holding only it)."""
    import shutil
    root = tmp / f"only-{step}"
    shutil.copytree(src / layout.step_dirname(step), root / layout.step_dirname(step))
    st = _big(-1.0)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        info = ck.restore(st)
    assert info is not None and info.step == step
    w = st.model.weight.detach()
    assert torch.all(w == w.flatten()[0])  # one value throughout: no mix of two saves
    return float(w.flatten()[0])


@pytest.mark.parametrize("mode", ["raise", "continue"])
def test_a_save_still_writing_never_lends_its_buffers(tmp_path: Path, mode: str) -> None:
    """The previous save outlived wait_timeout_s: the next save must not stage into the host
    buffers it is still writing from (that would commit a mix of two steps with valid
    CRCs). raise: save() raises; continue: the save is skipped, its handle holds the error.
    Once the slow write ends, saving works again and both checkpoints hold their own values."""
    root = tmp_path / "t1"
    st = _big(1.0)
    with tierckpt.CheckpointManager(tier1=root, keep_last=5,
                                    failures=Failures(wait_timeout_s=0.01,
                                                      on_save_error=mode)) as ck:
        first = ck.save(1, st)
        with torch.no_grad():
            st.model.weight.fill_(2.0)
        if mode == "raise":
            with pytest.raises(SaveError, match="still writing"):
                ck.save(2, st)
        else:
            err = ck.save(2, st).durable.exception(timeout=0)
            assert isinstance(err, SaveError) and "skipped" in str(err)
        first.wait(timeout=600)
        with torch.no_grad():
            st.model.weight.fill_(3.0)
        ck.save(3, st).wait(timeout=600)
    assert _weight_of(tmp_path, root, 1) == 1.0
    assert _weight_of(tmp_path, root, 3) == 3.0
    assert not (root / layout.step_dirname(2)).exists()


def test_save_handle_wait_raises_the_builtin_timeout_error(tmp_path: Path) -> None:
    """concurrent.futures.TimeoutError is not TimeoutError before Python 3.11."""
    st = _big(1.0)
    with tierckpt.CheckpointManager(tier1=tmp_path) as ck:
        h = ck.save(1, st)
        with pytest.raises(TimeoutError, match="still writing") as e:
            h.wait(timeout=0)  # 128 MiB are not written in no time
        assert type(e.value) is TimeoutError
        h.wait(timeout=600)
