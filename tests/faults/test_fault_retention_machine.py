"""A hypothesis state machine over a real tier-1 root (F17 and the resume oracle).

Rules interleave saves, restarts (close, reopen, restore), crash debris (a tmp directory
of a killed save, or a final-named directory whose ``COMPLETE`` was never written), damage
to committed checkpoints (truncated or flipped shard, missing marker, wrong digest),
deletions by hand, pins (``pins/step-XXXXXXXX.<holder>``) and tier-2 uploads by the real
in-process :class:`tierckpt.tier2.uploader.Uploader` to a ``file://`` tier 2 (its upload state
and pins are what tier-1 retention must honour: ``upload_every=2``).

Properties:

* every reopen restores exactly the newest checkpoint that is intact on tier 1 or
  complete on tier 2, with that step's weights (and none when there is none);
* a checkpoint disappears from tier 1 only by our hand, or by retention when it is neither
  pinned nor waiting for upload and at least ``keep_last`` newer complete ones exist;
* once a checkpoint has been committed, an intact one always remains on tier 1 (damage and
  deletion by hand are only applied while another intact one exists).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as hst
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tierckpt
from tests.faults._oracle import TALLY, committed, make_state, set_weights, weights_step
from tierckpt import Tier2
from tierckpt.errors import IntegrityError
from tierckpt.format import layout
from tierckpt.policy import retention
from tierckpt.restore.verify import verify_checkpoint
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage
from tierckpt.tier2.uploader import Uploader, UploaderConfig

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

KEEP = 2
UPLOAD_EVERY = 2
DAMAGES = ("truncate", "flip", "drop_marker", "bad_digest")


class RetentionResume(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="tierckpt-machine-"))
        self.root = self.base / "tier1"
        (self.base / "tier2").mkdir()  # a file:// tier 2 must exist: opening one never creates it
        self.tier2 = f"file://{self.base / 'tier2'}"
        self.ck: tierckpt.CheckpointManager | None = None
        self.state = make_state(0)
        self.next_step = 1
        self.intact: set[int] = set()     # committed, undamaged, on tier 1 (the model)
        self.damaged: set[int] = set()    # committed, damaged by us, still on tier 1
        self.pins: set[int] = set()
        self.ever_committed = False

    # -- helpers ---------------------------------------------------------------------------
    def _remote(self) -> set[int]:
        with open_storage(self.tier2) as st:
            return set(Tier2Catalog(st).complete_steps())

    def _open(self) -> tierckpt.CheckpointManager:
        """(Re)start the job: open a manager and restore; check the oracle's choice."""
        if self.ck is not None:
            return self.ck
        expected = max(self.intact | (self._remote() if self.root.exists() else set()),
                       default=None)
        # the invariant here: nothing is deleted before its upload (backlog=None)
        self.ck = tierckpt.CheckpointManager(
            tier1=self.root, keep_last=KEEP, verify="full",
            tier2=Tier2(self.tier2, upload_every=UPLOAD_EVERY, start_uploader=False,
                        backlog=None))
        st = make_state(-1)
        info = self.ck.restore(st)
        chosen = None if info is None else info.step
        TALLY.add("state machine: restart + restore")
        assert chosen == expected, (chosen, expected, self.intact, self.damaged)
        if info is not None:
            assert weights_step(st) == float(chosen)
            self.intact.add(info.step)  # fetched back from tier 2 if tier 1 lacked it
            self.damaged = {s for s in self.damaged if s < info.step}  # newer: quarantined
        return self.ck

    def _crash(self) -> None:
        """The job dies: the lock is released with the process; nothing is waited for."""
        if self.ck is not None:
            self.ck.close()
            self.ck = None

    # -- rules -----------------------------------------------------------------------------
    @rule()
    def save(self) -> None:
        ck = self._open()
        step = self.next_step
        self.next_step += 1
        before = set(committed(self.root))
        cat = Tier1Catalog(self.root)
        done, asked = cat.uploads.uploaded_steps(), cat.uploads.split_pins()[1]
        set_weights(self.state.model, step)
        ck.save(step, self.state).wait()
        asked |= Tier1Catalog(self.root).uploads.split_pins()[1]  # this commit may be the Nth
        held = retention.tier1_upload_holds(before | {step}, upload_every=UPLOAD_EVERY,
                                            done=done, marked=asked)
        self.intact.add(step)
        self.ever_committed = True
        TALLY.add("state machine: save + retention")
        after = set(committed(self.root))
        assert step in after
        for gone in sorted(before - after):
            newer = [s for s in after if s > gone]
            assert gone not in self.pins, f"pinned step {gone} deleted"
            assert gone not in held, f"step {gone} deleted before its upload"
            assert len(newer) >= KEEP, f"step {gone} deleted with only {newer} newer"
            self.intact.discard(gone)
            self.damaged.discard(gone)

    @rule()
    def restart(self) -> None:
        self._crash()
        self._open()

    @rule(kind=hst.sampled_from(["tmp", "unmarked_final"]))
    def crash_mid_save(self, kind: str) -> None:
        """Leave what a save killed mid-way leaves, then die."""
        self._crash()
        if not self.root.exists():
            return
        step = self.next_step
        self.next_step += 1
        src = next(iter(sorted(self.intact)), None)
        name = (layout.tmp_dirname(step, "killed") if kind == "tmp"
                else layout.step_dirname(step))
        d = self.root / name
        if src is not None:  # a plausible half: the files, no marker
            shutil.copytree(self.root / layout.step_dirname(src), d)
            (d / layout.COMPLETE).unlink()
        else:
            d.mkdir()
        TALLY.add(f"state machine: crash debris ({kind})")

    @precondition(lambda self: len(self.intact) >= 2)
    @rule(data=hst.data(), kind=hst.sampled_from(DAMAGES))
    def damage(self, data: hst.DataObject, kind: str) -> None:
        step = data.draw(hst.sampled_from(sorted(self.intact)))
        d = self.root / layout.step_dirname(step)
        shard = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
        if kind == "truncate":
            os.truncate(shard, shard.stat().st_size // 2)
        elif kind == "flip":
            b = bytearray(shard.read_bytes())
            b[len(b) // 2] ^= 0x40
            shard.write_bytes(bytes(b))
        elif kind == "drop_marker":
            (d / layout.COMPLETE).unlink()
        else:
            body = json.loads((d / layout.COMPLETE).read_bytes())
            body["manifest_sha256"] = "0" * 64
            (d / layout.COMPLETE).write_text(json.dumps(body))
        self.intact.discard(step)
        if kind != "drop_marker":
            self.damaged.add(step)
        TALLY.add(f"state machine: damage ({kind})")

    @precondition(lambda self: len(self.intact) >= 2)
    @rule(data=hst.data())
    def delete_by_hand(self, data: hst.DataObject) -> None:
        step = data.draw(hst.sampled_from(sorted(self.intact)))
        shutil.rmtree(self.root / layout.step_dirname(step))
        self.intact.discard(step)

    @precondition(lambda self: bool(self.intact))
    @rule(data=hst.data())
    def pin(self, data: hst.DataObject) -> None:
        step = data.draw(hst.sampled_from(sorted(self.intact)))
        pins = self.root / layout.PINS
        pins.mkdir(exist_ok=True)
        (pins / layout.pin_filename(step, "test")).touch()
        self.pins.add(step)

    @precondition(lambda self: bool(self.pins))
    @rule(data=hst.data())
    def unpin(self, data: hst.DataObject) -> None:
        step = data.draw(hst.sampled_from(sorted(self.pins)))
        (self.root / layout.PINS / layout.pin_filename(step, "test")).unlink()
        self.pins.discard(step)

    @precondition(lambda self: self.root.exists())
    @rule()
    def upload(self) -> None:
        with Uploader(UploaderConfig(tier1=self.root, tier2=self.tier2,
                                     upload_every=UPLOAD_EVERY)) as up:
            results = up.drain()
        remote = self._remote()
        for r in results:
            if r.status == "verified":
                assert r.step in remote and r.step not in self.damaged
        TALLY.add("state machine: tier-2 upload")

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def intact_ones_are_there_and_verify(self) -> None:
        if not self.root.exists():
            return
        present = set(committed(self.root))
        assert self.intact <= present, (self.intact, present)
        for step in self.intact:
            try:
                verify_checkpoint(self.root / layout.step_dirname(step), step=step, full=True)
            except IntegrityError as e:
                raise AssertionError(f"intact step {step} does not verify: {e}") from e
        if self.ever_committed:
            assert self.intact, "every committed checkpoint is gone"

    def teardown(self) -> None:
        try:
            self._crash()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


RetentionResume.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERCKPT_MACHINE_EXAMPLES", "30")),
    stateful_step_count=20, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_retention_and_resume_machine = RetentionResume.TestCase
