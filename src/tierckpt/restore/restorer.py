"""One restore, start to end: agree on a step, set newer entries aside, fetch what a domain
lacks from tier 2, load — and when a checkpoint that verified fails while loading, set it
aside and try the next older one; when a step chosen from tier 2 cannot be fetched because
its bytes there are damaged or missing, skip it (logged) and choose again. Collective:
every rank of the job calls it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tierckpt.errors import (
    CheckpointError,
    CorruptDataError,
    IntegrityError,
    StorageError,
    Tier2CopyDamagedError,
    Tier2OutageError,
)
from tierckpt.format import layout
from tierckpt.restore.choose import Chooser
from tierckpt.restore.loader import RestoreInfo, load_into
from tierckpt.restore.verify import Verify, verify_checkpoint
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm
from tierckpt.save.config import Writes
from tierckpt.state import TrainState
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.config import Tier2
from tierckpt.tier2.storage import open_storage

_log = logging.getLogger("tierckpt")

OUTAGE_FIRST_WAIT_S = 5.0
OUTAGE_MAX_WAIT_S = 60.0
"""Waits between tries while tier 2 holds the only copy and does not answer: 5 s doubling
to 60 s, within ``Tier2.outage_wait_s``."""

Chosen = tuple[int, str, tuple[tuple[int, str], ...], int, int, str | None]
"""``(step, source, skipped, bytes fetched (tier 2, or a partner's RAM), saved world size,
this domain's source)``."""


class Restorer:
    """Restores into a :class:`TrainState` from this process's tier-1 root (``catalog``),
    in its ``domain``: checks candidates per ``verify``, falls back to ``tier2`` (within its
    ``timeout_s``), and creates what it fetches with ``writes``' modes."""

    def __init__(self, catalog: Tier1Catalog, comm: Comm, domain: tuple[int, ...], *,
                 verify: Verify, is_owner: bool, log: events.EventLog,
                 tier2: Tier2 | None = None, tier2_down: str | None = None,
                 writes: Writes | None = None,
                 tier0: Tier0Root | None = None,
                 domains: tuple[tuple[int, ...], ...] = ()) -> None:
        self.catalog, self.comm, self.domain = catalog, comm, domain
        self.verify, self.tier2, self.writes = verify, tier2, writes or Writes()
        self.tier2_down = tier2_down
        self.is_owner, self.log = is_owner, log
        self.tier0, self.domains = tier0, domains or (tuple(domain),)

    def restore(self, state: TrainState) -> RestoreInfo | None:
        """The loaded checkpoint, or None on a fresh start (nothing restorable anywhere).
        Raises :class:`CorruptDataError` when candidates existed but none could be loaded
        (``state`` then holds part of one)."""
        t0 = time.monotonic()
        self.log.emit(events.RESTORE_STARTED)
        tried = _Tried()
        while True:
            try:
                chosen = self._choose_through_outage(
                    exclude=frozenset(tried.failed) | frozenset(tried.unreadable))
            except Tier2CopyDamagedError as e:
                self._skip_damaged(e.step, str(e), tried)
                continue
            if chosen is None:
                if tried.failed:
                    raise CorruptDataError(
                        f"no checkpoint could be loaded (failed while reading: "
                        f"{tried.failed}); the state holds part of one of them: build it "
                        "anew to start fresh")
                return None
            step, source, skipped, fetched, saved_world, mine = chosen
            in_ram = mine in ("tier0", "tier0-peer") and self.tier0 is not None
            path = (self.tier0.path if in_ram and self.tier0 is not None
                    else self.catalog.root) / layout.step_dirname(step)
            t_load = time.monotonic()
            try:
                nbytes = self._load(state, step, path, saved_world, in_ram=in_ram)
                break
            except CorruptDataError as e:
                self._after_failure(step, source, e, tried)
        now = time.monotonic()
        self.log.emit(events.STATE_LOADED, step=step, seconds=now - t_load)
        info = RestoreInfo(step=step, source=source, path=path, seconds=now - t0,
                           bytes_read=nbytes + fetched,
                           bytes_by_source=_bytes_by_source(mine, nbytes, fetched),
                           world_size=self.comm.world_size, saved_world_size=saved_world,
                           skipped=(*skipped, *tried.bad_copies, *tried.unreadable.items(),
                                    *tried.failed.items()))
        self.log.emit(events.RESTORE_DONE, step=step, seconds=info.seconds,
                      bytes=info.bytes_read, source=source,
                      bytes_by_source=info.bytes_by_source, world_size=info.world_size,
                      saved_world_size=saved_world)
        if info.resharded and self.comm.rank == 0:  # one line for the job, not one per rank
            _log.warning("%s", reshard_note(step, saved_world, info.world_size))
        return info

    def _load(self, state: TrainState, step: int, path: Path, saved_world: int, *,
              in_ram: bool = False) -> int:
        """Load ``step`` from ``path`` (:func:`load_into`), logging each metadata fallback it
        noted; returns the bytes this rank read."""
        notes: list[str] = []
        nbytes = load_into(state, path, saved_world, self.comm,
                           readers=len(self.domain), notes=notes, in_ram=in_ram)
        for note in notes:
            self.log.emit(events.METADATA_FALLBACK, step=step, reason=note)
            _log.warning("step %d: %s", step, note)
        return nbytes

    def _after_failure(self, step: int, source: str, e: CorruptDataError,
                       tried: _Tried) -> None:
        """``step`` verified but failed while loading from ``source``: what is tried next.
        Once, the step again without its RAM copies (re-verified on every rank); once, the
        step from tier 2 after the local copy is set aside; else never again."""
        sources = set(source.split("+"))
        if sources & {"tier0", "tier0-peer"} and step not in tried.rechecked:  # every rank
            tried.rechecked.add(step)
            self._recheck_tier0(step, str(e))
            return  # the step again, without the RAM copies that failed
        self._set_aside(step, str(e))
        if "tier2" not in sources and self.tier2 is not None and \
                step not in {s for s, _ in tried.bad_copies}:
            # same step first: tier 2 may hold it verified; the chooser fetches it
            # there now that the local copy is gone, else moves to an older step
            tried.bad_copies.append((step, f"tier 1: {e}"))
            return
        tried.failed[step] = str(e)

    def _recheck_tier0(self, step: int, error: str) -> None:
        """After a load from RAM failed while reading (tier-0 copies are checked by size
        before use and by CRC32C while read, not twice): each owner verifies its copy of
        ``step`` in full and removes it if it fails, with the reason logged."""
        if not (self.is_owner and self.tier0 is not None):
            return
        d = self.tier0.own.step_dir(step)
        if not os.path.lexists(d):
            return
        try:
            verify_checkpoint(d, step=step, domain=self.domain,
                              world_size=self.comm.world_size, full=True)
        except (IntegrityError, OSError) as e:
            reason = f"tier 0: {e} (the load failed: {error})"
            with contextlib.suppress(OSError):
                self.tier0.own.delete(step)
            self.log.emit(events.CHECKPOINT_SKIPPED, step=step, reason=reason, moved_to=None)
            _log.warning("tier 0 step %d removed: %s", step, reason)

    def _skip_damaged(self, step: int, reason: str, tried: _Tried) -> None:
        """``step`` was chosen from tier 2 and its bytes there are bad (a content object
        damaged or missing): logged and never chosen again; an older step is tried (none
        left: a fresh start, as when every tier-1 candidate fails to verify)."""
        tried.unreadable[step] = reason
        self.log.emit(events.CHECKPOINT_SKIPPED, step=step, reason=reason, moved_to=None)
        if self.comm.rank == 0:
            _log.warning("step %d cannot be read from tier 2 and is skipped: %s. Later steps "
                         "that share a damaged object are damaged too until it is sent "
                         "again: tierckpt verify --all --tier 2 --tier2 URL --repair --tier1 "
                         "DIR, on a node whose tier 1 holds it", step, reason)

    def _set_aside(self, step: int, reason: str) -> None:
        """A step that failed to load leaves every root (quarantined with the reason)."""
        moved = None
        if self.is_owner and os.path.lexists(self.catalog.step_dir(step)):
            moved = self.catalog.quarantine(step, reason)
        if self.is_owner and self.tier0 is not None:
            with contextlib.suppress(OSError):  # RAM is a cache: the bad copy just goes
                self.tier0.own.delete(step)
        self.log.emit(events.CHECKPOINT_SKIPPED, step=step, reason=reason,
                      moved_to=str(moved) if moved else None)
        if self.comm.rank == 0:  # every rank holds the same, job-wide reason: log it once
            _log.warning("step %d failed to load and was set aside: %s", step, reason)

    def _choose_through_outage(self, exclude: frozenset[int]) -> Chosen | None:
        """:meth:`_choose`, tried again while tier 2 holds the only copy and does not
        answer (:class:`Tier2OutageError` on every rank), with a backoff and a warning per
        wait, for up to ``Tier2.outage_wait_s``: a restart during a tier-2 outage waits
        for it instead of failing at once and using up the launcher's restarts. Then the
        error is raised, saying how long it waited. Collective (every rank waits alike)."""
        limit = self.tier2.outage_wait_s if self.tier2 is not None else 0.0
        t0, wait = time.monotonic(), OUTAGE_FIRST_WAIT_S
        while True:
            try:
                return self._choose(exclude)
            except Tier2OutageError as e:
                waited = time.monotonic() - t0
                if waited + wait > limit:
                    raise Tier2OutageError(
                        f"{e}; waited {waited:.0f} s (Tier2.outage_wait_s={limit:g}). Run the "
                        "job again once tier 2 answers, or point tier2 elsewhere") from None
                self.log.emit(events.TIER2_UNAVAILABLE, reason=str(e), retry_in_s=wait,
                              waited_s=round(waited, 1), outage_wait_s=limit)
                if self.comm.rank == 0:
                    _log.warning("tier 2 holds the only copy of this run and does not answer "
                                 "(%s); trying again in %.0f s (%.0f of %g s waited)",
                                 e, wait, waited, limit)
                time.sleep(wait)
                wait = min(wait * 2, OUTAGE_MAX_WAIT_S)
                self.tier2_down = None  # ask tier 2 itself again, not the start-up probe

    def _chooser(self, exclude: frozenset[int]) -> Chooser:
        tier2, down = self.tier2, self.tier2_down
        opener = (lambda: Tier2Catalog(open_storage(tier2.url))) \
            if tier2 is not None and self.is_owner else None
        if opener is not None and down is not None:  # one bounded wait per start: the probe's
            opener = _known_down(down)
        return Chooser(self.catalog, self.comm, self.domain, is_owner=self.is_owner,
                       full=self.verify is Verify.FULL, log=self.log, open_remote=opener,
                       tier2_timeout_s=tier2.timeout_s if tier2 is not None else 60.0,
                       exclude=exclude,
                       tier0=self.tier0, domains=self.domains)

    def _choose(self, exclude: frozenset[int]) -> Chosen | None:
        """Collective: agree on a step (not one of ``exclude``), set newer entries aside,
        fetch what this domain lacks; None when nothing is restorable."""
        comm, w = self.comm, self.writes
        with self._chooser(exclude) as chooser:
            step = chooser.choose()
            if self.is_owner:  # nothing restorable: whatever is left would block new saves
                chooser.set_aside_newer(-1 if step is None else step)
            skipped = tuple(s for sk in comm.all_gather(chooser.skipped) for s in sk)
            if step is None:
                self.log.emit(events.CHECKPOINT_CHOSEN, step=None, source=None,
                              skipped=[list(s) for s in skipped], tier2_lists=chooser.lists)
                return None
            mine = chooser.sources.get(step) if self.is_owner else None
            owners = comm.all_gather(mine)
            source = "+".join(sorted({s for s in owners if s}))
            mine = owners[self.domain[0]]  # my domain's source, on every rank of it
            self.log.emit(events.CHECKPOINT_CHOSEN, step=step, source=source,
                          skipped=[list(s) for s in skipped], tier2_lists=chooser.lists)
            fetched, err, damaged = 0, None, False
            try:
                fetched = chooser.pull(step)  # collective: replicas back from partners
            except (CheckpointError, OSError) as e:
                err = f"rank {comm.rank}: pulling step {step} from the partner failed: {e}"
            if self.is_owner and err is None:
                try:
                    fetched += chooser.materialize(step, file_mode=w.file_mode,
                                                   dir_mode=w.dir_mode)
                except (CheckpointError, OSError) as e:
                    err = f"rank {comm.rank}: fetching step {step} from tier 2 failed: {e}"
                    damaged = chooser.damaged_on_tier2(step, e)
            failed = [r for r in comm.all_gather((err, damaged)) if r[0]]
            if failed:  # every rank raises alike: the next choice is collective too
                message = "; ".join(str(e) for e, _ in failed)
                if all(d for _, d in failed):
                    raise Tier2CopyDamagedError(step, message)
                raise CheckpointError(message)
            saved_world = comm.broadcast(
                chooser.manifests[step].world_size if comm.rank == 0 else None)
        return step, source, skipped, fetched, saved_world, mine


@dataclasses.dataclass
class _Tried:
    """What one restore learned from the loads that failed while reading."""

    failed: dict[int, str] = dataclasses.field(default_factory=dict)
    """Verified, yet failed to load: never chosen again."""
    rechecked: set[int] = dataclasses.field(default_factory=set)
    """Steps whose tier-0 copies were re-verified in full."""
    bad_copies: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    """Local copies set aside, the step retried (from tier 2)."""
    unreadable: dict[int, str] = dataclasses.field(default_factory=dict)
    """Chosen from tier 2, whose copy is damaged or incomplete: never chosen again."""


def _bytes_by_source(mine: str | None, nbytes: int, fetched: int) -> dict[str, int]:
    """The bytes of a restore by where they came from: ``nbytes`` read from this domain's
    source ``mine``, ``fetched`` from tier 2 or a partner's RAM."""
    if mine == "tier0-peer":  # pulled from a partner's RAM, then read from this node's
        return {"tier0": nbytes, "tier0-peer": fetched, "tier1": 0, "tier2": 0}
    if mine == "tier0":
        return {"tier0": nbytes, "tier0-peer": 0, "tier1": 0, "tier2": 0}
    return {"tier0": 0, "tier0-peer": 0, "tier1": nbytes, "tier2": fetched}


def reshard_note(step: int, saved_world: int, world: int) -> str:
    """The line a restore logs (once, on rank 0) when ``step`` was saved by ``saved_world``
    ranks and is loaded by ``world``: what the reshard keeps and what it re-derives
    (:mod:`tierckpt.state`, "Resume semantics")."""
    return (f"step {step} was saved by {saved_world} rank(s) and is restored onto {world}: "
            "model and optimizer resharded, scheduler and extra kept, a ResumableSampler "
            "continues from the global sample position, each rank's RNG streams "
            f"re-derived (losses will not match a {saved_world}-rank run bit for bit)")


def _known_down(reason: str) -> Callable[[], Tier2Catalog]:
    def refuse() -> Tier2Catalog:
        raise StorageError(f"it did not answer the start-up probe ({reason}); not asked "
                           "again during this start")
    return refuse
