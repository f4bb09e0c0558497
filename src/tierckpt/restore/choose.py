"""Agree with every domain owner on the step to restore, verifying candidates on the way.

Choosing is a collective over domain owners (see :mod:`tierckpt.runtime.topology`): each
owner proposes the newest step that verifies in its own tier-1 root (or on tier 2) at or
below a bound; the bound drops to the smallest proposal until every owner proposes the same
step. A candidate that fails verification is moved to ``quarantine/`` with its reason (never
deleted) and logged, and the next older one is tried.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tierckpt.errors import (
    CheckpointError,
    IntegrityError,
    MissingFilesError,
    ObjectNotFoundError,
    SignatureError,
    StorageError,
    Tier2OutageError,
)
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.restore.verify import required_ranks, verify_checkpoint
from tierckpt.runtime import events
from tierckpt.runtime.deadline import call_with_deadline
from tierckpt.runtime.topology import Comm
from tierckpt.tier0.replicate import remove_newer, ring
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier0.transfer import Stream, commit_received, transfer
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.fs import remove_tree
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.fetch import fetch_into_tier1

T = TypeVar("T")
_log = logging.getLogger("tierckpt")


def _drop(catalog: Tier1Catalog, step: int) -> None:
    """Remove a tier-0 entry that failed verification (RAM is a cache; the reason is
    logged by the caller)."""
    try:
        catalog.delete(step)
    except OSError:
        path = catalog.step_dir(step)
        if path.is_symlink() or path.is_file():
            os.unlink(path)

class Chooser:
    """Agrees with every domain owner on the newest step restorable everywhere, each
    domain from its own tier 1 when intact there, else from tier 2 (when configured).

    Tier 2 can only make a restore better, never block it: ``open_remote`` (called at most
    once, lazily) and every tier-2 read run under a ``tier2_timeout_s`` deadline; a tier 2
    that fails or does not answer is logged (``tier2_unavailable``, the ``tierckpt``
    logger) and left out. Only when no domain then has anything to restore does the outage
    matter: :meth:`choose` refuses to call that a fresh start. A context manager: ``close``
    releases the tier-2 client.
    """

    def __init__(self, local: Tier1Catalog, comm: Comm, domain: tuple[int, ...], *,
                 is_owner: bool, full: bool, log: events.EventLog,
                 open_remote: Callable[[], Tier2Catalog] | None = None,
                 tier2_timeout_s: float = 60.0, exclude: frozenset[int] = frozenset(),
                 tier0: Tier0Root | None = None,
                 domains: tuple[tuple[int, ...], ...] = ()) -> None:
        self.local, self.comm, self.domain = local, comm, domain
        self.is_owner, self.full, self.log = is_owner, full, log
        self._open_remote, self.tier2_timeout_s = open_remote, tier2_timeout_s
        self.exclude = exclude  # steps that verified but failed to load (on any tier)
        self.remote: Tier2Catalog | None = None
        self.remote_error: str | None = None  # why tier 2 was left out, if it was
        self.skipped: list[tuple[int, str]] = []
        self.refused: str | None = None  # a signature failure: restore() raises, everywhere
        self.manifests: dict[int, mf.Manifest] = {}
        self.sources: dict[int, str] = {}
        self._checked: set[int] = set()
        self._remote: list[int] | None = None
        self.lists = 0
        """Tier-2 LISTs this rank issued (at most one per job: :meth:`share_listing`)."""
        self.tier0, self.domains = tier0, domains
        self.offers: dict[int, mf.Committed] = {}
        """Replicas of this domain's checkpoints that its partner holds in RAM (verified
        there in full, marker checked here)."""

    def close(self) -> None:
        if self.remote is not None:
            self.remote.storage.close()
            self.remote = None

    def __enter__(self) -> Chooser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tier2(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` under the tier-2 deadline; errors become :class:`StorageError`."""
        try:
            return call_with_deadline(fn, self.tier2_timeout_s, what)
        except TimeoutError as e:
            raise StorageError(str(e)) from None

    def remote_steps(self) -> list[int]:
        """Complete tier-2 steps ([] without a tier 2, or when it is unavailable)."""
        if self._remote is not None:
            return self._remote
        self._remote = []
        if self._open_remote is None:
            return self._remote
        try:
            remote = self._remote_catalog()
            self.lists += 1
            self._remote = self._tier2(remote.complete_steps, f"listing {remote.storage.url}")
        except (CheckpointError, OSError) as e:
            self._tier2_unavailable(f"{type(e).__name__}: {e}")
        return self._remote

    def _remote_catalog(self) -> Tier2Catalog:
        """The tier-2 catalogue, opened on first use (under the tier-2 deadline)."""
        if self.remote is None:
            assert self._open_remote is not None
            self.remote = self._tier2(self._open_remote, "opening tier 2")
        return self.remote

    def share_listing(self) -> None:
        """Collective: one tier-2 LIST for the whole job, not one per node. Rank 0 lists
        (when it reads tier 2) and every other owner takes its answer — the complete steps,
        or why tier 2 is left out — instead of listing the same prefix again: at hundreds
        of nodes, simultaneous LISTs are what a store throttles first. Where rank 0 does
        not read tier 2, each owner lists for itself."""
        listing = None
        if self.comm.rank == 0 and self._open_remote is not None:
            listing = (self.remote_steps(), self.remote_error)
        listing = self.comm.broadcast(listing)
        if listing is not None and self._open_remote is not None and self.comm.rank != 0:
            self._remote, self.remote_error = listing

    def _tier2_unavailable(self, reason: str) -> None:
        self.remote_error = reason
        self.log.emit(events.TIER2_UNAVAILABLE, reason=reason)
        _log.warning("tier 2 is left out of this restore: %s", reason)

    def _skip(self, step: int, reason: str, moved: Path | None = None) -> None:
        self.skipped.append((step, reason))
        self.log.emit(events.CHECKPOINT_SKIPPED, step=step, reason=reason,
                      moved_to=str(moved) if moved else None)

    def _check(self, step: int) -> None:
        """Fill ``sources[step]``/``manifests[step]`` if ``step`` is restorable here."""
        self._checked.add(step)
        if self._check_tier0(step):
            return
        d = self.local.step_dir(step)
        missing_reason = None
        if os.path.lexists(d):
            try:
                self.manifests[step] = verify_checkpoint(
                    d, step=step, domain=self.domain, world_size=self.comm.world_size,
                    full=self.full)
                self.sources[step] = "tier1"
                return
            except MissingFilesError as e:
                missing_reason = str(e)
            except SignatureError as e:
                # Tampering or the wrong key: refuse loudly, move nothing. With a wrong key
                # every candidate fails, and quarantining them all would silently restart
                # training from scratch.
                self.refused = f"{d}: {e}"
                return
            except (IntegrityError, OSError) as e:
                self._skip(step, str(e), self.local.quarantine(step, str(e)))
        if step in self.remote_steps():
            try:
                remote = self._remote_catalog()
                self.manifests[step] = self._tier2(
                    lambda: remote.read_committed(step).manifest,
                    f"reading step {step} from {remote.storage.url}")
                self.sources[step] = "tier2"
                return
            except SignatureError as e:
                self.refused = f"tier 2 step {step}: {e}"
                return
            except (CheckpointError, OSError) as e:
                self._skip(step, f"tier 2: {e}")
        if missing_reason is not None:
            self._skip(step, missing_reason)

    def _check_tier0(self, step: int) -> bool:
        """``step`` from this node's RAM (checked like tier 1 here — sizes, ``.metadata``'s
        CRC32C, every byte with ``verify="full"`` — and every byte's CRC32C while it is read;
        a copy that fails then is verified in full and removed, and the step is looked for
        on the other sources: :class:`~tierckpt.restore.restorer.Restorer`), else from the
        partner's replica (verified in full by its holder before it is offered). A failing
        tier-0 copy is removed (RAM is a cache) with the reason logged."""
        if self.tier0 is None:
            return False
        d = self.tier0.own.step_dir(step)
        if os.path.lexists(d):
            try:
                self.manifests[step] = verify_checkpoint(
                    d, step=step, domain=self.domain, world_size=self.comm.world_size,
                    full=self.full)
                self.sources[step] = "tier0"
                return True
            except SignatureError as e:
                self.refused = f"tier 0 {d}: {e}"
                return True
            except MissingFilesError:
                pass  # intact, but a reshard needs other nodes' shards: tier 1 or 2
            except (IntegrityError, OSError) as e:
                self._skip(step, f"tier 0: {e}")
                _log.warning("tier 0 step %d not used: %s", step, e)
                _drop(self.tier0.own, step)
        offer = self.offers.get(step)
        if offer is not None:
            self.manifests[step] = offer.manifest
            self.sources[step] = "tier0-peer"
            return True
        return False

    def exchange_offers(self) -> None:
        """Collective: every owner offers the replicas it holds (each fully verified for
        the domain it belongs to), and learns which of its own its partner holds."""
        mine: dict[int, tuple[bytes, bytes]] = {}
        ring_ = ring(self.domains, self.domain) if self.tier0 is not None else None
        if self.is_owner and self.tier0 is not None and ring_ is not None:
            pred = ring_[1]
            for step in self.tier0.peer.complete_steps():
                d = self.tier0.peer.step_dir(step)
                try:
                    verify_checkpoint(d, step=step, domain=pred,
                                      world_size=self.comm.world_size, full=True)
                    c = self.tier0.peer.read_committed(step)
                    mine[step] = (c.manifest_bytes, c.marker_bytes)
                except MissingFilesError:
                    pass  # another world size: this replica cannot serve it
                except (IntegrityError, OSError) as e:
                    self.log.emit(events.CHECKPOINT_SKIPPED, step=step,
                                  reason=f"tier 0 replica for ranks {list(pred)}: {e}",
                                  moved_to=None)
                    _log.warning("tier 0 replica of step %d (ranks %s) not offered: %s",
                                 step, list(pred), e)
                    _drop(self.tier0.peer, step)
        gathered = self.comm.all_gather(mine)
        if not (self.is_owner and ring_ is not None):
            return
        for step, (mbytes, marker) in gathered[ring_[0][0]].items():
            try:
                self.offers[step] = mf.verify_committed(marker, mbytes, step=step,
                                                        name=f"tier 0 replica step {step}")
            except IntegrityError as e:
                self._skip(step, f"tier 0 replica: {e}")

    def pull(self, step: int) -> int:
        """Collective: a domain whose chosen source is its partner's replica receives
        those files into its own tier 0 (CRC-checked, committed); the partner sends them.
        Returns bytes received by this rank."""
        mine = self.sources.get(step) if self.is_owner else None
        sources = self.comm.all_gather(mine)
        if self.tier0 is None or not self.is_owner:
            return 0
        streams: list[Stream] = []
        tmp = None
        m = self.manifests.get(step)
        ring_ = ring(self.domains, self.domain)
        if ring_ is None:
            return 0
        partner, pred = ring_
        if sources[self.domain[0]] == "tier0-peer" and m is not None:
            tmp = self.tier0.own.root / layout.tmp_dirname(step, m.save_id)
            tmp.mkdir()
            streams.append(Stream(peer=partner[0], directory=tmp,
                                  files=m.files_for_ranks(self.domain), receive=True))
        if sources[pred[0]] == "tier0-peer":  # I hold the predecessor's replica
            rm = self.tier0.peer.read_committed(step).manifest
            streams.append(Stream(peer=pred[0], directory=self.tier0.peer.step_dir(step),
                                  files=rm.files_for_ranks(pred), receive=False))
        try:
            got = transfer(self.comm, streams)
            if tmp is not None:
                commit_received(tmp, self.tier0.own.step_dir(step), self.offers[step],
                                file_mode=0o640)
        except BaseException:
            if tmp is not None and tmp.exists():
                remove_tree(tmp)
            raise
        return got

    def _newest_valid(self, bound: float) -> int | None:
        t0_steps: set[int] = set()
        if self.tier0 is not None:
            t0_steps = set(self.tier0.own.complete_steps()) | set(self.offers)
        for step in sorted(set(self.local.candidate_steps()) | set(self.remote_steps())
                           | t0_steps, reverse=True):
            if step > bound or step in self.exclude:
                continue
            if step not in self._checked:
                self._check(step)
            if self.refused is not None:
                return None
            if step in self.sources:
                return step
        return None

    def choose(self) -> int | None:
        """Collective. The agreed step, or None when no domain has any checkpoint.
        Raises CheckpointError when some domains can restore and others cannot, and
        :class:`SignatureError` on every rank when a signing key is set and a candidate is
        unsigned or badly signed (it is left where it is, not quarantined)."""
        self.exchange_offers()
        self.share_listing()
        bound: float = float("inf")
        while True:
            proposal = self._newest_valid(bound) if self.is_owner else "n/a"
            gathered = self.comm.all_gather((proposal, self.refused))
            refused = [r for _, r in gathered if r is not None]
            if refused:
                raise SignatureError(
                    f"refusing to restore {refused[0]}. Set {mf.SIGNING_KEY_ENV} to the key the "
                    "checkpoints were saved with, or move an untrusted checkpoint out of the way")
            props = [p for p, _ in gathered if p != "n/a"]
            if all(p is None for p in props):
                self._no_fresh_start_without_tier2()
                return None
            if any(p is None for p in props):
                raise CheckpointError(
                    "some tier-1 roots have a complete checkpoint and others have none "
                    f"(newest per domain: {props}); a replaced node needs tier 2 (tier2=...) "
                    "to restore")
            low = min(props)
            if all(p == low for p in props):
                return int(low)
            bound = low

    def _no_fresh_start_without_tier2(self) -> None:
        """Collective. Nothing to restore on any tier 1 and some tier 2 unavailable: that
        is not a fresh start (tier 2 may hold the run), so raise on every rank."""
        errors = [e for e in self.comm.all_gather(self.remote_error) if e]
        if errors:
            raise Tier2OutageError(
                "no tier-1 root holds a checkpoint and tier 2 could not be read "
                f"({errors[0]}); refusing to start training from scratch over what tier 2 "
                "may hold")

    def set_aside_newer(self, step: int) -> None:
        """Owner only: move every final-named entry newer than the agreed ``step`` out of
        this root (quarantined, not deleted), so the run can commit those steps again —
        e.g. a step one node committed and another did not, or a newer one skipped."""
        for newer in self.local.candidate_steps():
            if newer > step:
                reason = (f"newer than the agreed restore point (step {step})" if step >= 0
                          else "not restorable on every node; the job starts fresh")
                self._skip(newer, reason, self.local.quarantine(newer, reason))
        if self.tier0 is not None:  # RAM is a cache: newer entries are dropped, not kept
            for cat in (self.tier0.own, self.tier0.peer):
                for gone in remove_newer(cat, step):
                    self._skip(gone, f"tier 0: newer than the agreed restore point "
                                     f"(step {step})")

    def materialize(self, step: int, *, file_mode: int, dir_mode: int) -> int:
        """Owner only: make ``step`` complete in this domain's tier 1 (fetching what is
        missing from tier 2); returns bytes downloaded."""
        if self.sources.get(step) != "tier2":
            return 0
        assert self.remote is not None
        m = self.manifests[step]
        ranks = required_ranks(m, self.domain, self.comm.world_size)
        names = [f.name for f in (m.files if ranks is None else m.files_for_ranks(ranks))]
        got, _ = fetch_into_tier1(self.remote, self.local, step, names=names, full=self.full,
                                  file_mode=file_mode, dir_mode=dir_mode)
        return got

    def damaged_on_tier2(self, step: int, error: BaseException) -> bool:
        """Whether a failed :meth:`materialize` of ``step`` says its bytes on tier 2 are bad,
        not that tier 2 did not answer: an object failed its CRC32C, or one is missing while
        the step's marker is there (a content object damaged or deleted behind the job's
        back). Such a step cannot come from tier 2; an older one is tried. A signature
        failure is not (it is refused loudly), nor any other error (tried again later)."""
        if isinstance(error, SignatureError) or self.remote is None:
            return False
        if isinstance(error, IntegrityError):
            return True
        if not isinstance(error, ObjectNotFoundError):
            return False
        try:
            return self.remote.storage.head(self.remote.key(step, layout.COMPLETE)) is not None
        except (CheckpointError, OSError):
            return False
