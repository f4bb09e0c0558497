"""The job's tier 0 from open to release: every domain owner opens its node's root
(collective), the RAM budget is checked at the first save (collective), and the lock is
released at close. Built from :class:`~tierckpt.tier0.config.Tier0` alone.

With ``Tier0()`` (the default location) a node that cannot open it, or a budget that does
not fit, turns tier 0 off for the whole job with a warning and a ``tier0_disabled`` event;
with an explicit path both are a :class:`ConfigError` on every rank.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tierckpt.errors import ConfigError, LockError
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm
from tierckpt.tier0 import recycle
from tierckpt.tier0.config import Tier0
from tierckpt.tier0.replicate import ring
from tierckpt.tier0.root import Tier0Root, auto_base, budget, default_root, remove_dead_roots
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.lock import FileLock

_log = logging.getLogger("tierckpt")

OVERHEAD = 1.02
"""Headroom on the measured shard bytes for file headers and DCP's ``.metadata``."""


class Tier0Session:
    """One job's tier 0 on this rank: ``root`` is None while tier 0 is off."""

    def __init__(self, config: Tier0, *, tier1: Path, comm: Comm,
                 domains: tuple[tuple[int, ...], ...], domain: tuple[int, ...],
                 is_owner: bool) -> None:
        self.config, self.tier1, self.comm = config, tier1, comm
        self.domains, self.domain, self.is_owner = domains, domain, is_owner
        self.root: Tier0Root | None = None
        self._lock: FileLock | None = None
        self._checked = False

    def open(self, *, dir_mode: int, file_mode: int) -> Tier0Root | None:
        """Collective: open every node's root; the root, or None where ``Tier0()`` turned
        tier 0 off. Raises ConfigError (explicit path) after releasing what it took."""
        cfg = self.config
        path = default_root(self.tier1) if cfg.auto else cfg.path
        assert path is not None
        root, err = Tier0Root(path=path, tier1=self.tier1), None
        if self.is_owner:
            try:
                if cfg.auto:
                    remove_dead_roots(auto_base(), keep=path)
                self._lock = root.open(dir_mode=dir_mode, file_mode=file_mode)
            except (ConfigError, LockError, OSError) as e:
                err = f"rank {self.comm.rank}: {e}"
        paths = self.comm.all_gather(str(path))
        if len({paths[r] for r in self.domain}) > 1:
            err = err or (f"ranks {list(self.domain)} share tier1 {self.tier1} but not tier0 "
                          f"({sorted({paths[r] for r in self.domain})}); give the ranks of a "
                          "node one tier0 directory")
        errors = [e for e in self.comm.all_gather(err) if e]
        if not errors:
            self.root = root
            return root
        self.release()
        if not cfg.auto:
            raise ConfigError(errors[0])
        _log.warning("tier0=Tier0(): running without tier 0: %s", errors[0])
        return None

    def check_budget(self, nbytes: int, log: events.EventLog) -> bool:
        """Collective, at the first save only (later calls return at once): tier 0's RAM
        need — own shards plus the partner's replica, times ``keep`` + 1 while a new one
        commits — against the tmpfs and host RAM. False when ``Tier0()`` turned tier 0 off
        (``root`` is then None); ConfigError with an explicit path."""
        if self._checked or self.root is None:
            return self.root is not None
        cfg, comm = self.config, self.comm
        self._checked = True
        sizes = comm.all_gather(nbytes)
        own = sum(sizes[r] for r in self.domain)
        pair = ring(self.domains, self.domain) if cfg.replicate else None
        peer = sum(sizes[r] for r in pair[1]) if pair is not None else 0
        need = int((cfg.keep + 1) * (own + peer) * OVERHEAD)
        msg = None
        if self.is_owner:
            b = budget(self.root.path, need)
            if not b.fits:
                msg = f"rank {comm.rank}: {b.message(self.root.path)}"
        errors = [m for m in comm.all_gather(msg) if m]
        if not errors:
            return True
        if not cfg.auto:
            raise ConfigError(errors[0])
        log.emit(events.TIER0_DISABLED, reason=errors[0])
        _log.warning("tier0=Tier0(): running without tier 0: %s", errors[0])
        self.release()
        return False

    def release(self, *, clean: bool = False) -> None:
        """Let go of the root's lock (idempotent); tier 0 is off from here on. With
        ``clean`` (a clean close), owners give back the pages kept for rewriting
        (``free/``), and, without ``Tier0.keep_on_close``, remove the node's RAM copies,
        but only when the newest of them is committed on tier 1."""
        root, self.root = self.root, None
        if clean and root is not None and self.is_owner:
            recycle.clear(root.free)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if clean and root is not None and self.is_owner and not self.config.keep_on_close:
            self._remove(root)

    def _remove(self, root: Tier0Root) -> None:
        own = root.own.complete_steps()
        if own and own[0] not in Tier1Catalog(self.tier1).complete_steps():
            _log.warning("tier 0: keeping %s: its newest step %d is not on tier 1", root.path,
                         own[0])
            return
        nbytes = sum(p.stat().st_size for p in root.path.rglob("*") if p.is_file())
        shutil.rmtree(root.path, ignore_errors=True)
        _log.info("tier 0: removed this node's RAM copies (%.1f MiB) at close; they are on "
                  "tier 1 (Tier0(keep_on_close=True) keeps them)", nbytes / 2**20)
