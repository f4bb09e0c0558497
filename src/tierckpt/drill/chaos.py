"""The chaos drill: one real job on simulated nodes through N seeded compound faults.

1. **reference** — the command uninterrupted on its own roots and tier 2: the losses every
   start must match, the save interval, ``keep_last`` and a checkpoint's size.
2. **plan** — N cycles drawn from the seed over the kinds that can be injected here
   (:func:`tierckpt.drill.chaos_verdicts.draw_plan`).
3. **cycles** — the job runs on ``<out>/runs/chaos/node<i>`` (each a size-limited tmpfs
   when the drill may mount one) with tier 2, and with ``tier0`` in node RAM too. A cycle
   waits for commits, injects its faults (:mod:`tierckpt.drill.chaos_faults`), and when
   they end the job waits until no process of it is left, checks every complete
   checkpoint, applies the at-rest faults, starts the job again itself (as a scheduler
   requeues it: at-rest faults then never race a restart; torchrun's own restart path is
   the kill drill's) and checks the restore and the next commit. Every invariant is a pure
   verdict of what was recorded.
4. **final** — the last start trains to the end; the final checkpoint must be complete on
   tier 2 and verify in full, and no process of the job may be left.

The modules, in the order they build on each other: :mod:`~tierckpt.drill.chaos_config`
(the config, the timing constants, the start and cycle records),
:mod:`~tierckpt.drill.chaos_state` (the job's state, its starts and the waits),
:mod:`~tierckpt.drill.chaos_starts` (restarts until a start commits, the restore and
at-rest verdicts), :mod:`~tierckpt.drill.chaos_cycle` (one fault cycle) and this one (the
run top down: reference, plan, cycles, final checks, teardown). They are one state machine
(the job, its starts, the faults in effect, what was seen) split by stage, one class each.

:func:`run_chaos` returns the report document and never raises for a violated invariant;
CheckpointError-worthy trouble of the drill itself (the reference failed, the job cannot
be restarted, steps ran out) ends the run with ``error`` set. ConfigError for bad input.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt.config import ManagerConfig
from tierckpt.drill import chaos_faults as cf
from tierckpt.drill import chaos_verdicts as cv
from tierckpt.drill import verdicts as vd
from tierckpt.drill.chaos_config import STAGES, STEPS_PER_CYCLE, ChaosConfig, CycleRecord
from tierckpt.drill.chaos_cycle import CycleRunner
from tierckpt.drill.chaos_heal import heal_catalogue
from tierckpt.drill.chaos_report import build_chaos_report, write_chaos_report
from tierckpt.drill.chaos_state import ram_arg, ram_root
from tierckpt.drill.drills import Progress, _require_empty_tier2
from tierckpt.drill.launch import JobSpec
from tierckpt.drill.runs import run_job
from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.format import layout
from tierckpt.ops.check import check_tier2
from tierckpt.runtime import events as ev
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.config import Tier2
from tierckpt.tier2.storage import open_storage

__all__ = ["STAGES", "STEPS_PER_CYCLE", "ChaosConfig", "run_chaos"]

_MIB = 1 << 20


def _noop(stage: str, state: str, detail: str) -> None:
    pass


def run_chaos(cfg: ChaosConfig, progress: Progress = _noop) -> dict[str, Any]:
    """Run the chaos drill (in a fresh ``<out>/runs``), write ``chaos-report.json`` and
    ``chaos-report.md`` into ``out`` (``doc["files"]``) and return the report document."""
    doc = _Chaos(cfg, progress).run()
    progress("report", "running", "")
    write_chaos_report(doc, cfg.out)
    progress("report", "passed" if doc["ok"] else "failed", doc["files"]["md"])
    return doc


class _Chaos(CycleRunner):
    """The run top down: reference, plan, cycles, final checks; teardown always."""

    # -- the run, top down ----------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.time()
        error = None
        plan: list[cv.CyclePlan] = []
        final = CycleRecord(None, -1)
        try:
            self._prepare()
            self._stage("reference", self._reference)
            self._mount()
            plan = cv.draw_plan(self.cfg.seed, self.cfg.cycles, nodes=self.cfg.nnodes,
                                kinds=[k for k in self.cfg.kinds
                                       if self.catalogue[k]["injectable"]],
                                save_every=self.save_every)
            self._check_budget(plan)
            self.progress("chaos", "running", "start 0")
            self._recover(self.first)
            for p in plan:
                self.progress("chaos", "running", f"cycle {p.index}/{len(plan)}: "
                              + ", ".join(f.label for f in p.faults))
                self._cycle(p)
            self.progress("chaos", "passed", f"{len(self.cycles)} cycles")
            self.progress("final", "running", "")
            self._final(final)
        except ConfigError:
            raise
        except (CheckpointError, OSError) as e:
            error = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
            self.progress("chaos", "failed", error)
        finally:
            self._teardown()
        return build_chaos_report(
            config=self._config_doc(), catalogue=self.catalogue, plan=plan,
            start=self._cycle_doc(self.first), cycles=[self._cycle_doc(c) for c in self.cycles],
            final=self._cycle_doc(final) if final.verdicts else None,
            restarts=max(0, len(self.starts) - 1), peaks=self.peaks,
            bound=cv.tier1_bound(self.keep_last, self.backlog), facts=self.facts,
            error=error, t0=t0)

    def _stage(self, name: str, fn: Callable[[], str]) -> None:
        self.progress(name, "running", "")
        try:
            detail = fn()
        except CheckpointError as e:
            self.progress(name, "failed", str(e))
            raise
        self.progress(name, "passed", detail)

    def _prepare(self) -> None:
        runs = self.cfg.out / "runs"
        cf.unmount_under(runs)  # a previous drill that died left its tmpfs mounted
        for ram in self._all_rams():  # a previous drill's RAM would be restored from
            shutil.rmtree(ram, ignore_errors=True)
        if runs.exists():
            shutil.rmtree(runs)
        default = self.cfg.out / "tier2"
        if self.url == f"file://{default}":  # the default tier 2 is ours: start it empty
            for d in (default, default.with_name("tier2.down")):
                if d.exists():
                    shutil.rmtree(d)
            default.mkdir(parents=True)  # a file:// tier 2 is never created by opening it
        _require_empty_tier2(self.url)
        self.base.mkdir(parents=True)

    def _reference(self) -> str:
        cfg = self.cfg
        base = cfg.out / "runs" / "reference"
        (base / "tier2").mkdir(parents=True)
        roots = self._reference_roots()
        run = run_job(JobSpec(name="reference", command=cfg.command, roots=roots,
                              losses=base / "losses.jsonl", steps=cfg.total_steps,
                              nproc=cfg.nproc, tier2=f"file://{base / 'tier2'}",
                              tier0=ram_arg(cfg, roots)),
                      timeout_s=cfg.run_timeout_s)
        if run.rc != 0:
            raise CheckpointError(f"the reference run failed (exit {run.rc}): "
                                  f"{run.log_tail[-1500:]}")
        logged = sorted(vd.losses_by_step(run.rows))
        saves = sorted({int(e["step"]) for e in run.of(ev.SAVE_COMMITTED)})
        if logged != list(range(cfg.total_steps)) or not saves:
            raise CheckpointError(f"the reference run logged steps {logged[:5]}... and saved "
                                  f"{saves[:5]}: the command must log every step and save")
        gaps = collections.Counter(b - a for a, b in itertools.pairwise(saves))
        self.save_every = gaps.most_common(1)[0][0] if gaps else saves[0] + 1  # not the last
        recorded = Tier1Catalog(roots[0]).recorded_policy()
        default: dict[str, Any] = {f.name: f.default for f in
                                   (*dataclasses.fields(ManagerConfig), *dataclasses.fields(Tier2))}
        self.keep_last = recorded.policy.keep_last if recorded else int(default["keep_last"])
        backlog = default["backlog"]  # not recorded: the library's default is assumed
        self.backlog = backlog if isinstance(backlog, int) else None
        self.ref_rows = run.rows
        per_node = [sum(p.stat().st_size for p in (r / layout.step_dirname(saves[-1])).iterdir())
                    for r in roots]
        self.facts.update(save_every=self.save_every, keep_last=self.keep_last,
                          upload_backlog=self.backlog, checkpoint_bytes_per_node=max(per_node),
                          reference_s=run.t_end - run.t_start, tier0=cfg.tier0,
                          tier0_roots=[str(r) if r else None for r in self.rams])
        if cfg.tier0 is not None and not run.of(ev.TIER0_SAVED):
            raise CheckpointError(f"the reference run saved nothing in tier 0 though --tier0 "
                                  f"{cfg.tier0} was given (tier0_disabled: "
                                  f"{[e.get('reason') for e in run.of(ev.TIER0_DISABLED)]}); "
                                  "the command must pass --tier0 to CheckpointManager(tier0=)")
        return f"{len(logged)} steps, a save every {self.save_every}"

    def _reference_roots(self) -> tuple[Path, ...]:
        base = self.cfg.out / "runs" / "reference"
        return tuple(base / f"node{i}" for i in range(self.cfg.nnodes))

    def _all_rams(self) -> list[Path]:
        """Every node RAM (tier-0 root) the drill's jobs use: the reference's and the
        chaos job's."""
        roots = (*self._reference_roots(), *self.roots)
        return [r for r in (ram_root(self.cfg, root) for root in roots) if r is not None]

    def _mount(self) -> None:
        why = None if self.cfg.tmpfs else "not asked for (tmpfs=False)"
        bound = cv.tier1_bound(self.keep_last, self.backlog) or self.keep_last + 8
        ckpt = int(self.facts["checkpoint_bytes_per_node"])
        # room for the bound, debris, and what restores quarantine (never deleted)
        size = max(32 * _MIB, ckpt * (bound + 6 + 2 * self.cfg.cycles) + 16 * _MIB)
        size = -(-size // _MIB) * _MIB
        for root in self.roots:
            if why is None:
                why = cf.mount_tmpfs(root, size)
                if why is None:
                    self.mounted.append(root)
            root.mkdir(parents=True, exist_ok=True)
        self.facts["tier1_tmpfs_bytes"] = size if why is None else None
        kill = "SIGKILL through /proc"
        self.catalogue = {k: {"injectable": True, "how": kill} for k in
                          ("kill_rank", "kill_uploader")}
        self.catalogue.update(
            tier2_down={"injectable": self.outage is not None,
                        "how": "rename the file:// directory away and back" if self.outage
                        else f"not a file:// tier 2 ({self.url})"},
            tier1_full={"injectable": why is None,
                        "how": "fill the node's tmpfs to ENOSPC, then free it" if why is None
                        else f"no tmpfs for the node roots: {why}"},
            damage={"injectable": True, "how": "edit the newest checkpoint at rest"},
            partial_commit={"injectable": True, "how": "remove the newest step dir on one "
                            "node at rest"},
            wipe_node={"injectable": True, "how": "empty the node's root at rest"
                       + (" and its RAM" if self.cfg.tier0 else "")},
            **{k: {"injectable": self.cfg.tier0 is not None, "how": how if self.cfg.tier0
                   else "no tier 0: give --tier0 auto|DIR"} for k, how in (
                ("wipe_ram", "remove the node's tier-0 root at rest"),
                ("damage_ram", "flip a shard byte of the node's newest RAM copy or replica "
                               "at rest"),
                ("kill_partner", "SIGKILL the replica holder's rank as a save is replicated "
                                 "to it"))},
            **{k: {"injectable": self.cfg.preempt, "how": how if self.cfg.preempt
                   else "not asked for: give --preempt"} for k, how in (
                ("notice_one_rank", "SIGUSR1 or SIGTERM to one node's rank only; the others "
                                    "learn of it through the job's store"),
                ("notice_in_save", "SIGTERM to one node's launcher (torchrun forwards it) as "
                                   "that node's rank writes a background save"),
                ("notice_then_kill", "SIGTERM to every launcher, then SIGKILL of every rank "
                                     "at once or once the emergency save began"))},
            clock_jump={"injectable": False, "how": "needs the system clock changed; "
                        "covered by tests/faults/test_fault_clock.py"})
        self.catalogue.update(heal_catalogue(self.cfg.heal, self.catalogue))
        self.catalogue.update(_object_catalogue(self.cfg.dedup, self.t2_root, self.url))
        if self.mounted and len(self.mounted) < len(self.roots):  # all or none
            for root in self.mounted:
                cf.unmount(root)
            self.mounted = []

    def _check_budget(self, plan: list[cv.CyclePlan]) -> None:
        need = cv.steps_needed(plan, save_every=self.save_every)
        if self.cfg.total_steps < need:
            raise ConfigError(f"--steps {self.cfg.total_steps} is too few for {len(plan)} "
                              f"cycles at a save every {self.save_every} steps: give "
                              f"--steps {need} or more")

    # -- the end --------------------------------------------------------------------------
    def _final(self, rec: CycleRecord) -> None:
        self.rec = rec
        rec.prev = self.cur.index
        self._wait_outage_over(rec)
        for _ in range(self.cfg.max_starts):
            start = self.cur
            if start.job.wait(self.cfg.run_timeout_s) == 0:
                break
            self._unexpected(rec, "ended", "the end of training")
        self._down(rec, self.cur, "finished")
        self._snapshot(rec)
        final_step = self.cfg.total_steps - 1
        steps = self._tier2_steps()
        check = None
        if steps is not None and final_step in steps:
            with open_storage(self.url) as storage:
                check = check_tier2(storage, final_step, scratch=self.base)
        left = [v for v in rec.verdicts if v.name == "processes"]
        rec.verdicts.append(cv.final_verdict(
            final_step=final_step, tier2_steps=steps, check_ok=bool(check and check.ok),
            check_error=check.error if check else None,
            leftovers=[c for v in left for c in v.facts["left"]],
            finished=self.cur.end == "finished"))
        self._close(rec, complete=True)  # the cycles judged their own starts and peaks
        bad = [v.name for v in rec.verdicts if not v.ok]
        self.progress("final", "failed" if bad else "passed",
                      ", ".join(bad) or f"step {final_step} on tier 2, verified")

    def _teardown(self) -> None:
        if self.starts and self._running():
            self.cur.job.kill()
        if self.outage is not None:
            with contextlib.suppress(OSError):
                self.outage.end()
        self._free_fill()
        for pid, _ in cf.processes(self.marker):
            cf.kill(pid)
        for tail in self.tails:
            tail.poll()
            self.facts[f"torn_event_lines_node{tail.node}"] = tail.torn
            with open(self.base / f"events-node{tail.node}.jsonl", "w") as f:
                f.writelines(_json_line(e) for e in tail.events)
        for root in self.mounted:
            log = root / layout.UPLOAD_STATE / "uploader.log"
            with contextlib.suppress(OSError):
                shutil.copy(log, self.base / f"uploader-{root.name}.log")
            cf.unmount(root)
        for ram in self._all_rams():  # node RAM is the next job's: a drill keeps none
            shutil.rmtree(ram, ignore_errors=True)


def _object_catalogue(dedup: bool, t2_root: Path | None, url: str) -> dict[str, Any]:
    """The object kinds: injectable with ``--dedup`` on a ``file://`` tier 2."""
    why = None if dedup and t2_root is not None else "not asked for: give --dedup" \
        if not dedup else f"not a file:// tier 2 ({url})"
    return {k: {"injectable": why is None, "how": why or how} for k, how in (
        ("damage_object", "flip a byte of, or delete, a content object only the newest "
                          "tier-2 step needs, at rest"),
        ("cut_deletion", "delete the oldest tier-2 step in a process SIGKILLed before a "
                         "seeded deletion, at rest"))}


def _json_line(e: dict[str, Any]) -> str:
    return json.dumps(e, default=str) + "\n"
