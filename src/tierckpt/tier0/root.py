"""Where a node keeps tier 0, whose it is, whether it fits, and what is stale.

A tier-0 root is a directory on tmpfs (``Tier0()``: ``<base>/<job key>``, the key derived
from the domain's tier-1 root, so a restarted worker finds its own and two jobs never share
one; the base is :func:`auto_base`). It has the layout of a tier-1 root — committed
``step-XXXXXXXX/`` directories written by the same writer and commit protocol, so the same
verification applies — plus::

    job.json                 whose tier 0 this is ({"tier1": "/abs/tier1/root"})
    .lock                    flock held by the job using it (dead jobs hold none)
    peer/step-XXXXXXXX/      the partner node's newest checkpoints (its replica), committed
                             with their own marker once every file's CRC32C matched
    free/                    shard files of a dropped step, whose RAM the next save rewrites
                             (:mod:`tierckpt.tier0.recycle`); never read as a checkpoint

A root whose ``job.json`` names another tier-1 root is never read, written or removed by
this job: opening it is a :class:`ConfigError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from tierckpt.errors import ConfigError, LockError
from tierckpt.tier1 import fs
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.lock import FileLock

DEFAULT_BASE = Path("/dev/shm/tierckpt")
TIER0_ENV = "TIERCKPT_TIER0"
"""The launch kit's tier-0 RAM volume (``tierckpt launch k8s --tier0-size``, ``launch slurm
--tier0``): ``Tier0()`` keeps its root in it."""
BASE_ENV = "TIERCKPT_TIER0_BASE"
"""Overrides :data:`DEFAULT_BASE` (the parent of ``Tier0()`` roots), e.g. another tmpfs."""
JOB_FILE = "job.json"
PEER_DIR = "peer"
FREE_DIR = "free"
LOCK_FILE = ".lock"
STALE_AFTER_S = 3600.0
"""A tier-0 root of another job, unlocked and untouched this long, is removed at start-up."""
HEADROOM = 0.10
"""Fraction of host RAM left free beyond tier 0 (the data loader, the allocator, the OS)."""


def job_key(tier1: Path) -> str:
    """The directory name of a tier-1 root's tier 0 under the default base."""
    return hashlib.sha256(str(Path(tier1).absolute()).encode()).hexdigest()[:16]


def auto_base() -> Path:
    """Where ``Tier0()`` roots live, first set wins: ``$TIERCKPT_TIER0`` (the directory the
    launch kit sets up for tier 0, e.g. a Kubernetes RAM volume whose ``sizeLimit`` the RAM
    budget then sees), ``$TIERCKPT_TIER0_BASE``, /dev/shm/tierckpt. ``Tier0(path=...)``
    wins over all of them (it is used as the root itself)."""
    for name in (TIER0_ENV, BASE_ENV):
        env = os.environ.get(name)
        if env:
            return Path(env)
    return DEFAULT_BASE


def default_root(tier1: Path) -> Path:
    """The ``Tier0()`` root of a tier-1 root."""
    return auto_base() / job_key(tier1)


@dataclasses.dataclass
class Tier0Root:
    """One node's tier 0 (opened by the domain owner; the other ranks only write shards
    into its save directories)."""

    path: Path
    tier1: Path

    @property
    def own(self) -> Tier1Catalog:
        """This node's committed tier-0 checkpoints."""
        return Tier1Catalog(self.path)

    @property
    def peer(self) -> Tier1Catalog:
        """The partner's replica held here."""
        return Tier1Catalog(self.path / PEER_DIR)

    @property
    def free(self) -> Path:
        """Shard files kept for the next save to rewrite (:mod:`tierckpt.tier0.recycle`)."""
        return self.path / FREE_DIR

    def open(self, *, dir_mode: int, file_mode: int) -> FileLock:
        """Create (or adopt) the root for this job, take its lock, and clean the debris of
        a crashed save or transfer. Raises :class:`ConfigError` if the root belongs to
        another job or cannot be written, :class:`LockError` if a live job holds it."""
        try:
            self.path.mkdir(mode=dir_mode, parents=True, exist_ok=True)
            (self.path / PEER_DIR).mkdir(mode=dir_mode, exist_ok=True)
            self.free.mkdir(mode=dir_mode, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"tier0={self.path} cannot be created ({e.strerror or e}); "
                              "give a writable directory on tmpfs (e.g. /dev/shm/...)") from e
        ident = self.path / JOB_FILE
        want = {"tier1": str(self.tier1)}
        if ident.exists():
            try:
                have = json.loads(ident.read_text())
            except (OSError, ValueError):
                have = None
            if have != want:
                raise ConfigError(
                    f"tier0={self.path} belongs to another job ({JOB_FILE} says {have!r}, this "
                    f"job's tier1 is {self.tier1}); its data is never loaded or removed. Give "
                    "this job its own tier0 directory")
        else:
            fs.write_durably(ident, json.dumps(want).encode(), mode=file_mode)
        lock = FileLock(self.path / LOCK_FILE, file_mode=file_mode, root=self.path,
                        busy=f"tier0 {self.path} is in use by another process ({{holder}})")
        try:
            self.own.clean_stale()
            self.peer.clean_stale()
        except OSError:
            lock.release()
            raise
        return lock

    def touch(self) -> None:
        """Record activity (another job's clean-up spares a root touched recently)."""
        with contextlib.suppress(OSError):
            os.utime(self.path / JOB_FILE)


def remove_dead_roots(base: Path, keep: Path, *, stale_after_s: float = STALE_AFTER_S,
                      now: float | None = None) -> list[Path]:
    """Remove tier-0 roots under ``base`` (other than ``keep``) whose job is gone: no live
    holder of their lock and no activity for ``stale_after_s``. Returns what was removed."""
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    now = time.time() if now is None else now
    for entry in os.scandir(base):
        path = Path(entry.path)
        if path == keep or not entry.is_dir(follow_symlinks=False):
            continue
        ident = path / JOB_FILE
        try:
            age = now - os.stat(ident).st_mtime
        except OSError:
            continue  # not a tier-0 root (or one being created): leave it alone
        if age < stale_after_s:
            continue
        try:
            lock = FileLock(path / LOCK_FILE, busy="held")
        except (LockError, OSError):
            continue  # a live job holds it
        try:
            fs.remove_tree(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            lock.release()
    return removed


@dataclasses.dataclass(frozen=True)
class Budget:
    """What tier 0 needs on one node and what the node has (bytes)."""

    need: int
    tmpfs_free: int
    ram_available: int

    @property
    def fits(self) -> bool:
        return self.need <= self.tmpfs_free and self.need <= self.ram_available * (1 - HEADROOM)

    def message(self, path: Path) -> str:
        gib = 1024 ** 3
        return (f"tier 0 needs {self.need / gib:.2f} GiB on this node (own checkpoints "
                f"and the partner's replica, x generations) but {path} has "
                f"{self.tmpfs_free / gib:.2f} GiB free and the host "
                f"{self.ram_available / gib:.2f} GiB of RAM available (keeping "
                f"{HEADROOM:.0%} free); lower Tier0.keep, turn off Tier0.replicate, or use "
                "tier0=Tier0() (no path) to run without tier 0 when it does not fit")


def budget(path: Path, need: int) -> Budget:
    """Free space of the file system at ``path`` and the host's available RAM."""
    st = os.statvfs(path)
    return Budget(need=need, tmpfs_free=st.f_bavail * st.f_frsize,
                  ram_available=_mem_available())


def _mem_available() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
