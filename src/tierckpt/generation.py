"""One generation of a :class:`~tierckpt.CheckpointManager`: everything bound to one
process group, opened together and let go of together.

A generation holds the checkpoint group (``comm``), the node's domains and lock (tier 1),
tier 0, the tier-2 link and its uploader, the event log, the staging gate, the async saver
and the preemption session. The manager opens one at start-up; a heal lets go of the failed
one (:meth:`Generation.leave`) and opens the next on the re-formed group; ``close()``
releases it (:meth:`Generation.release`). The generation decides nothing about *what* to
save: the manager's public API does, over the parts it holds here.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from concurrent.futures import Future

from tierckpt.config import ManagerConfig
from tierckpt.errors import CheckpointError
from tierckpt.format import layout
from tierckpt.preempt.session import PreemptSession, resolve_grace
from tierckpt.runtime import events
from tierckpt.runtime.cadence import Cadence
from tierckpt.runtime.save_cost import SaveCostMeter
from tierckpt.runtime.steps import StepMarks
from tierckpt.runtime.topology import Comm, discover_domains
from tierckpt.save.gate import StagingGate
from tierckpt.save.inflight import InFlight
from tierckpt.save.retention import Tier1Retention
from tierckpt.save.saver import AsyncSaver, SaveHandle, SaveJob, SaveResult
from tierckpt.save.staging import HostStager
from tierckpt.state import TrainState
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier0.session import Tier0Session
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.session import Tier1Session
from tierckpt.tier2.link import Tier2Link

LEAVE_WAIT_S = 1.0
"""How long a heal waits for the failed generation's in-flight save before abandoning it."""


class Generation:
    """The parts of one manager bound to one process group (see the module docstring).

    Construction is collective (every rank of ``comm``): it prepares the tier-1 root,
    discovers the domains, takes the lock, opens tier 0, probes tier 2, agrees the run id
    and the newest committed step, starts the uploader and the saver. A failure part-way
    releases what was opened and raises.
    """

    def __init__(self, cfg: ManagerConfig, catalog: Tier1Catalog, comm: Comm) -> None:
        self.comm, self._catalog = comm, catalog
        self.tier1: Tier1Session | None = None
        self.tier0_session: Tier0Session | None = None
        self.tier2: Tier2Link | None = None
        self.events: events.EventLog | None = None
        self.preempt: PreemptSession | None = None
        try:
            self._open(cfg)
        except BaseException:
            self.release(drain=False, step=None)
            raise

    def _open(self, cfg: ManagerConfig) -> None:
        comm, w = self.comm, cfg.writes
        self._catalog.prepare(dir_mode=w.dir_mode, file_mode=w.file_mode)
        self.domains = discover_domains(cfg.tier1, comm)
        self.domain = next(d for d in self.domains if comm.rank in d)
        self.is_owner = self.domain[0] == comm.rank
        self.tier1 = Tier1Session(self._catalog, comm, is_owner=self.is_owner)
        self.tier1.open(file_mode=w.file_mode)
        if cfg.tier0 is not None:
            self.tier0_session = Tier0Session(cfg.tier0, tier1=cfg.tier1, comm=comm,
                                              domains=self.domains, domain=self.domain,
                                              is_owner=self.is_owner)
            self.tier0_session.open(dir_mode=w.dir_mode, file_mode=w.file_mode)
        if cfg.tier2 is not None:
            self.tier2 = Tier2Link(cfg.tier2, catalog=self._catalog, comm=comm,
                                   is_owner=self.is_owner)
            self.tier2.probe(dir_mode=w.dir_mode)
        self.events = log = events.EventLog(cfg.tier1 / layout.EVENTS, rank=comm.rank,
                                            mode=w.file_mode)
        self.run_id: str = comm.broadcast(uuid.uuid4().hex[:12])
        self.newest = self._agree_newest()
        if self.tier2 is not None:
            self.tier2.start(cfg.retention, log, file_mode=w.file_mode, dir_mode=w.dir_mode)
        self._open_save_path(cfg, log)
        if cfg.preemption is not None:
            grace = comm.broadcast(resolve_grace(cfg.preemption) if comm.rank == 0 else None)
            self.preempt = PreemptSession(
                cfg.preemption, store=comm.store(), rank=comm.rank,
                world_size=comm.world_size, run_id=self.run_id, log=log,
                events_path=cfg.tier1 / layout.EVENTS, grace=grace)

    def _agree_newest(self) -> int | None:
        """The newest step committed on any node's tier 1 or tier 0 (collective)."""
        roots = [self._catalog] + ([self.tier0.own] if self.tier0 is not None else [])
        mine = [s for r in roots for s in r.complete_steps()[:1]] if self.is_owner else []
        newest = max(self.comm.all_gather(max(mine, default=-1)))
        return None if newest < 0 else newest

    def _open_save_path(self, cfg: ManagerConfig, log: events.EventLog) -> None:
        """The stager, gate, in-flight slot, step marks, cadence and saver."""
        self.stager = HostStager()
        self.incremental = cfg.writes.incremental
        self.full_every = cfg.writes.full_every
        self._incremental_saves = 0  # every full_every-th copies and writes the frozen too
        self.gate = StagingGate(log)
        self.inflight = InFlight(cfg.failures, log)
        self.steps = StepMarks(log, SaveCostMeter(log))
        self.cadence = None if cfg.interval is None else Cadence(
            cfg.interval, self.comm, log, cfg.tier1 / layout.EVENTS)
        if self.cadence is None:
            self.gate.on_step = lambda: self.steps.completed(busy=self.saving())
        t0 = self.tier0_session
        self.saver = AsyncSaver(
            cfg.tier1, cfg.writes, self.comm, self.domains, log,
            on_committed=Tier1Retention(self._catalog, cfg.retention,
                                        uploader=cfg.tier2 is not None, log=log),
            tier0=self.tier0, tier0_config=cfg.tier0,
            tier0_fits=None if t0 is None else functools.partial(t0.check_budget, log=log))

    @property
    def tier0(self) -> Tier0Root | None:
        """This node's tier 0 (None: off, or turned off because it did not fit)."""
        return self.tier0_session.root if self.tier0_session is not None else None

    @property
    def log(self) -> events.EventLog:
        """The event log (open once construction returned)."""
        assert self.events is not None
        return self.events

    def saving(self) -> bool:
        """A save is still in flight (not yet committed or failed)."""
        h = self.inflight.handle
        return h is not None and not h.done()

    def submit(self, step: int, state: TrainState, *, overlap: bool) -> SaveHandle:
        """Stage ``state`` into host buffers (``overlap``: the deferred part in the
        background), then hand it to the saver, which picks the tier and writes and commits
        it in the background. Returns once staged (the blocked time C)."""
        t0 = time.monotonic()
        state.step = step
        self.gate.watch(state.optimizer)  # waits for overlapped copies; marks steps
        keep = state.frozen_filter() if self.incremental else None
        if keep is not None:
            self._incremental_saves += 1
        staged = self.stager.stage(
            state.state_dict(), defer=state.overlap_filter() if overlap else None, keep=keep,
            refresh=(self._incremental_saves - 1) % self.full_every == 0)
        staged_at, nbytes = time.monotonic(), staged.nbytes
        handle = SaveHandle(step=step, staged=Future(), durable=Future())
        self.gate.begin(step=step, blocked_s=staged_at - t0, nbytes=nbytes,
                        deferred_bytes=staged.deferred_bytes, ready=staged.ready,
                        staged=handle.staged)
        try:
            to_tier1 = self.saver.to_tier1(nbytes)
        except BaseException:
            self.gate.settle()  # the buffers are not handed to a writer: let go
            raise
        self.inflight.handle = handle
        self.saver.submit(SaveJob(step=step, staged=staged.tree, nbytes=nbytes,
                                  save_id=f"{self.run_id}-{step}", started=t0,
                                  staged_at=staged_at, to_tier1=to_tier1,
                                  ready=staged.ready, frozen=staged.frozen, kept=staged.kept,
                                  kept_bytes=staged.kept_bytes), handle)
        self.steps.saving(step, t0)
        if self.cadence is not None:
            self.cadence.saved(step)
        return handle

    def request_upload(self, step: int) -> None:
        """Ask the uploader for ``step`` by name (the domain owner writes the ask)."""
        if self.tier2 is not None and self.is_owner:
            self._catalog.request_upload(step)

    def carry(self, step: int, result: SaveResult) -> None:
        """After a notice: carry the emergency save of ``step`` as far as the grace allows
        (tier 0 → tier 1 → tier 2; :meth:`PreemptSession.carry_save`)."""
        assert self.preempt is not None
        self.preempt.carry_save(step, nbytes=result.bytes_total, tier=result.tier,
                                tier0=self.tier0 is not None, tier2=self.tier2 is not None,
                                flush=lambda: self.saver.flush_to_tier1(result),
                                request_upload=self.request_upload)

    def keep(self, last: SaveResult) -> None:
        """At a clean close: the newest save reaches tier 1 if it is in RAM only, and is
        asked of tier 2 by name (the drain in :meth:`release` copies it)."""
        if last.tier == "tier0" and self.tier0 is not None:
            self.saver.flush_to_tier1(last)
        self.request_upload(last.step)

    def stop_writing(self) -> None:
        """Close the saver (bounded: a stuck write is abandoned) and the stager."""
        self.saver.close(wait=not self.inflight.stuck)
        self.stager.close()

    def leave(self) -> None:
        """Let go of everything bound to this (failed) generation's group, as a close after
        an error does. The in-flight save gets :data:`LEAVE_WAIT_S` to end (its collectives
        fail with the dead peer), then is abandoned: a coordinator waiting in a gather for
        the dead rank's part is not woken by an abort (gloo's receive waits out its
        timeout), and it can never commit — no survivor answers the old group again — so it
        ends in its own ``save_failed`` and its tmp directory is debris the next start
        removes."""
        self.gate.close()
        with contextlib.suppress(CheckpointError):  # it failed with the peer: expected
            self.inflight.finish(record_overlap=False, timeout=LEAVE_WAIT_S)
        try:
            self.stop_writing()
        finally:
            self.release(drain=False, step=None, closing=False)

    def release(self, *, drain: bool, step: int | None, closing: bool = True) -> None:
        """Drain tier 2 (bounded; by the grace after a notice) when ``drain``, finish the
        preemption session, log ``manager_closed`` at ``step`` when ``closing`` (a launcher
        tells a finished job from one cut short by it, not by a heal), release the lock,
        tier 0, the event log and the group. Safe on a part-way opened generation."""
        p, left = self.preempt, None
        if self.tier2 is not None:
            c = p.carry if p is not None else None
            left = self.tier2.close(drain=drain, drain_s=c.drain_s if c else None)
        if p is not None:
            p.finish(tier2_left=left)
            p.close()
        if closing and self.events is not None:
            self.events.emit(events.MANAGER_CLOSED, clean=drain,
                             stopped=p is not None and p.carry is not None, step=step)
        if self.tier1 is not None:
            self.tier1.release()
        if self.tier0_session is not None:
            self.tier0_session.release(clean=drain)
        if self.events is not None:
            self.events.close()
        self.comm.close()
