"""Agree with every domain owner on the step to restore, verifying candidates on the way.

Choosing is a collective over domain owners (see :mod:`tierckpt.runtime.topology`): each
owner proposes the newest step that verifies in its own tier-1 root (or on tier 2) at or
below a bound; the bound drops to the smallest proposal until every owner proposes the same
step. A candidate that fails verification is moved to ``quarantine/`` with its reason (never
deleted) and logged, and the next older one is tried.
"""

from __future__ import annotations

import os
from pathlib import Path

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
from tierckpt.runtime.topology import Comm
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.fetch import fetch_into_tier1


class Chooser:
    """Agrees with every domain owner on the newest step restorable everywhere, each
    domain from its own tier 1 when intact there, else from tier 2 (when configured)."""

    def __init__(self, local: Tier1Catalog, comm: Comm, domain: tuple[int, ...], *,
                 is_owner: bool, full: bool, log: events.EventLog,
                 remote: Tier2Catalog | None = None) -> None:
        self.local, self.comm, self.domain = local, comm, domain
        self.is_owner, self.full, self.log = is_owner, full, log
        self.remote = remote
        self.skipped: list[tuple[int, str]] = []
        self.refused: str | None = None  # a signature failure: restore() raises, everywhere
        self.manifests: dict[int, mf.Manifest] = {}
        self.sources: dict[int, str] = {}
        self._checked: set[int] = set()
        self._remote: list[int] | None = None

    def remote_steps(self) -> list[int]:
        if self._remote is None:
            self._remote = [] if self.remote is None else self.remote.complete_steps()
        return self._remote

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
            assert self.remote is not None
            try:
                self.manifests[step] = self.remote.read_committed(step).manifest
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
            if step > bound:
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
