"""Tier 0's copies elsewhere: the replica on the partner node (node n → node n+1 mod N, one
replica) and the copy to tier 1 (disk). Both are verified before they are committed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tierckpt.errors import CorruptDataError
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.runtime.topology import Comm
from tierckpt.tier0 import recycle
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier0.transfer import Stream, commit_received, transfer
from tierckpt.tier1 import fs
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.commit import commit_domain
from tierckpt.tier1.directio import DirectFile

_BLOCK = 16 * 1024 * 1024


def ring(domains: tuple[tuple[int, ...], ...], domain: tuple[int, ...]
         ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(partner, predecessor)``: the domain this one's replica goes to, and the one whose
    replica this one holds; None with a single domain (no other node to hold one)."""
    if len(domains) < 2:
        return None
    i = domains.index(domain)
    return domains[(i + 1) % len(domains)], domains[(i - 1) % len(domains)]


def holder_of(domains: tuple[tuple[int, ...], ...], domain: tuple[int, ...]
              ) -> tuple[int, ...] | None:
    """The domain holding ``domain``'s replica (its partner)."""
    r = ring(domains, domain)
    return None if r is None else r[0]


def replicate(comm: Comm, domains: tuple[tuple[int, ...], ...], domain: tuple[int, ...],
              root: Tier0Root, committed: mf.Committed, *, file_mode: int, dir_mode: int,
              bandwidth: float | None = None) -> int:
    """Owners of every domain, together: send this node's files of the committed step to
    the partner and receive the predecessor's into ``peer/`` (verified, then committed).
    Returns bytes received."""
    r = ring(domains, domain)
    if r is None:
        return 0
    partner, pred = r
    m = committed.manifest
    tmp = root.peer.root / layout.tmp_dirname(m.step, m.save_id)
    tmp.mkdir(mode=dir_mode)
    streams = [Stream(peer=partner[0], directory=root.own.step_dir(m.step),
                      files=m.files_for_ranks(domain), receive=False),
               Stream(peer=pred[0], directory=tmp, files=m.files_for_ranks(pred),
                      receive=True)]
    try:
        got = transfer(comm, streams, bandwidth=bandwidth)
        commit_received(tmp, root.peer.step_dir(m.step), committed, file_mode=file_mode)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.remove_tree(tmp)
        raise
    return got


def copy_to_tier1(src: Path, tier1: Tier1Catalog, committed: mf.Committed, *,
                  file_mode: int, dir_mode: int, fsync: bool, direct_io: bool) -> int:
    """Write the committed tier-0 checkpoint ``src`` to tier 1 with the save's own commit
    protocol (tmp dir, O_DIRECT + fsync, manifest, rename, ``COMPLETE``); every file's
    CRC32C, computed on the way, must match the manifest (RAM can rot too). Returns bytes."""
    m = committed.manifest
    tmp = tier1.root / layout.tmp_dirname(m.step, m.save_id)
    tmp.mkdir(mode=dir_mode)
    total = 0
    try:
        for entry in m.files:
            path = src / layout.safe_member_name(entry.name)
            if not path.exists():
                continue  # another node's shard (node-local tier 0 holds only its own)
            out = DirectFile(tmp / entry.name, mode=file_mode, direct=direct_io, fsync=fsync)
            try:
                with open(path, "rb", buffering=0) as f:
                    while block := f.read(_BLOCK):
                        out.write(block)
                out.close()
            except BaseException:
                out.abort()
                raise
            if out.crc != entry.crc32c or out.size != entry.size:
                raise CorruptDataError(f"tier 0 {path}: CRC32C or size does not match the "
                                       "manifest (damaged in RAM); not copied to tier 1")
            total += out.size
        commit_domain(tmp, tier1.step_dir(m.step), manifest_bytes=committed.manifest_bytes,
                      marker_bytes=committed.marker_bytes, metadata_bytes=None,
                      file_mode=file_mode)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.remove_tree(tmp)
        raise
    return total


def keep_newest(catalog: Tier1Catalog, keep: int, free: Path | None = None) -> list[int]:
    """Delete all but the ``keep`` newest committed checkpoints of a tier-0 catalogue (own
    or peer); returns the deleted steps. Tier 0 is a cache: nothing is pinned there. With
    ``free``, the newest deleted step's shard files are kept there for the next save to
    rewrite (:func:`tierckpt.tier0.recycle.retire`)."""
    doomed = catalog.complete_steps()[keep:]
    for i, step in enumerate(doomed):
        with contextlib.suppress(FileNotFoundError):
            if free is not None and i == 0:
                recycle.retire(catalog, step, free)
            else:
                catalog.delete(step)
    for stale in catalog.stale_entries():  # a half-deleted one from a crash
        with contextlib.suppress(OSError):
            fs.remove_tree(stale)
    return doomed


def remove_newer(catalog: Tier1Catalog, step: int) -> list[int]:
    """Delete every entry newer than ``step`` (a restore agreed on ``step``)."""
    gone = [s for s in catalog.candidate_steps() if s > step]
    for s in gone:
        path = catalog.step_dir(s)
        with contextlib.suppress(FileNotFoundError):
            if path.is_dir() and not path.is_symlink():
                catalog.delete(s)
            else:
                os.unlink(path)
    return gone
