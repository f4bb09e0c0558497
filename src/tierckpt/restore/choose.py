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
    SignatureError,
    StorageError,
)
from tierckpt.format import manifest as mf
from tierckpt.restore.verify import required_ranks, verify_checkpoint
from tierckpt.runtime import events
from tierckpt.runtime.deadline import call_with_deadline
from tierckpt.runtime.topology import Comm
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.fetch import fetch_into_tier1

T = TypeVar("T")
_log = logging.getLogger("tierckpt")

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
                 tier2_timeout_s: float = 60.0, exclude: frozenset[int] = frozenset()
                 ) -> None:
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
            if self.remote is None:
                self.remote = self._tier2(self._open_remote, "opening tier 2")
            remote = self.remote
            self._remote = self._tier2(remote.complete_steps, f"listing {remote.storage.url}")
        except (CheckpointError, OSError) as e:
            self._tier2_unavailable(f"{type(e).__name__}: {e}")
        return self._remote

    def _tier2_unavailable(self, reason: str) -> None:
        self.remote_error = reason
        self.log.emit(events.TIER2_UNAVAILABLE, reason=reason)
        _log.warning("tier 2 left out of this restore (tier 1 is used): %s", reason)

    def _skip(self, step: int, reason: str, moved: Path | None = None) -> None:
        self.skipped.append((step, reason))
        self.log.emit(events.CHECKPOINT_SKIPPED, step=step, reason=reason,
                      moved_to=str(moved) if moved else None)

    def _check(self, step: int) -> None:
        """Fill ``sources[step]``/``manifests[step]`` if ``step`` is restorable here."""
        self._checked.add(step)
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
            remote = self.remote
            assert remote is not None
            try:
                self.manifests[step] = self._tier2(
                    lambda: remote.read_committed(step).manifest,
                    f"reading step {step} from {remote.storage.url}")
                self.sources[step] = "tier2"
                return
            except SignatureError as e:
                self.refused = f"tier 2 step {step}: {e}"
                return
            except (IntegrityError, StorageError) as e:
                self._skip(step, f"tier 2: {e}")
        if missing_reason is not None:
            self._skip(step, missing_reason)

    def _newest_valid(self, bound: float) -> int | None:
        for step in sorted(set(self.local.candidate_steps()) | set(self.remote_steps()),
                           reverse=True):
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
            raise CheckpointError(
                "no tier-1 root holds a checkpoint and tier 2 could not be read "
                f"({errors[0]}); refusing to start training from scratch over what tier 2 "
                "may hold. Restart once tier 2 answers, or point tier2 elsewhere")

    def set_aside_newer(self, step: int) -> None:
        """Owner only: move every final-named entry newer than the agreed ``step`` out of
        this root (quarantined, not deleted), so the run can commit those steps again —
        e.g. a step one node committed and another did not, or a newer one skipped."""
        for newer in self.local.candidate_steps():
            if newer > step:
                reason = (f"newer than the agreed restore point (step {step})" if step >= 0
                          else "not restorable on every node; the job starts fresh")
                self._skip(newer, reason, self.local.quarantine(newer, reason))

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
