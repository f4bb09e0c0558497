"""Move checkpoint files between nodes' tier 0 over the checkpoint's gloo group (TCP: the
same code runs beside CPU and NCCL training), verified and committed on arrival.

A transfer is a set of *streams*: this rank sends some files to a peer rank, or receives
some files from one. Both ends derive the same pieces (``PIECE`` bytes) from the file list
(names and sizes from the manifest both sides hold), so no headers travel; in each round
every stream moves its next piece (``batch_isend_irecv``). A received file is written to a
temporary directory with its CRC32C computed on the way and must match the manifest before
the directory is committed (manifest, rename, ``COMPLETE`` last — the tier-1 protocol), so a
replica that would restore wrong data is never committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tierckpt.errors import CorruptDataError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.runtime.topology import Comm
from tierckpt.tier1 import fs
from tierckpt.tier1.commit import commit_domain

PIECE = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Stream:
    """Files to send to rank ``peer`` from ``directory``, or (``receive``) to receive from
    it into ``directory``."""

    peer: int
    directory: Path
    files: tuple[mf.FileEntry, ...]
    receive: bool

    def pieces(self) -> list[tuple[mf.FileEntry, int, int]]:
        out = []
        for f in sorted(self.files, key=lambda e: e.name):
            out += [(f, off, min(PIECE, f.size - off)) for off in range(0, f.size, PIECE)]
        return out


def transfer(comm: Comm, streams: list[Stream], *, bandwidth: float | None = None) -> int:
    """Run ``streams`` (every rank named in one must call this with the matching stream);
    returns bytes received. Received files are CRC-checked against their entries
    (:class:`CorruptDataError` on a mismatch). ``bandwidth`` (bytes/s) paces this rank's
    sends. A rank with no stream returns at once."""
    if not streams:
        return 0
    plans = [s.pieces() for s in streams]
    arrivals = _Arrivals()
    t0 = time.monotonic()
    sent = 0
    try:
        arrivals.open(streams)
        for i in range(max(len(p) for p in plans)):
            sent += _round(comm, streams, plans, i, arrivals)
            if bandwidth:
                ahead = sent / bandwidth - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        arrivals.verify(streams)
    finally:
        arrivals.close()
    return arrivals.received


def _round(comm: Comm, streams: list[Stream], plans: list[list[tuple[mf.FileEntry, int, int]]],
           i: int, arrivals: _Arrivals) -> int:
    """Move piece ``i`` of every stream that has one (one ``batch_isend_irecv``); returns
    the bytes this rank sent."""
    ops, landing, sent = [], [], 0
    for k, (s, plan) in enumerate(zip(streams, plans, strict=True)):
        if i >= len(plan):
            continue
        entry, off, n = plan[i]
        if s.receive:
            buf = torch.empty(n, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, buf, s.peer, group=comm.group))
            landing.append((k, entry, off, buf))
        else:
            data = _read(s.directory / layout.safe_member_name(entry.name), off, n)
            ops.append(dist.P2POp(dist.isend, data, s.peer, group=comm.group))
            sent += n
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for k, entry, off, buf in landing:
        arrivals.land(k, entry, off, buf)
    return sent


class _Arrivals:
    """The files this rank receives, keyed by (stream index, name): open descriptors, the
    CRC32C so far, bytes received, and the first write error. ``close()`` closes them all."""

    def __init__(self) -> None:
        self.fds: dict[tuple[int, str], int] = {}
        self.crcs: dict[tuple[int, str], int] = {}
        self.received = 0
        self.failed: OSError | None = None

    def open(self, streams: list[Stream]) -> None:
        """Create every received file at its full size (every file exists, even an empty one)."""
        for k, s in enumerate(streams):
            if s.receive:
                for f in s.files:
                    fd = os.open(s.directory / layout.safe_member_name(f.name),
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
                    os.ftruncate(fd, f.size)
                    self.fds[(k, f.name)], self.crcs[(k, f.name)] = fd, 0

    def land(self, k: int, entry: mf.FileEntry, off: int, buf: torch.Tensor) -> None:
        """Checksum a received piece and write it at ``off``."""
        mv = buf.numpy().data.cast("B")
        self.crcs[(k, entry.name)] = checksum.extend(self.crcs[(k, entry.name)], mv)
        self.received += len(mv)
        if self.failed is None:  # after a failure keep receiving (the sender must not
            try:                 # block on us), but write nothing more
                os.pwrite(self.fds[(k, entry.name)], mv, off)
            except OSError as e:
                self.failed = e

    def verify(self, streams: list[Stream]) -> None:
        """Raise the first write error, or :class:`CorruptDataError` for a file whose CRC32C
        is not its entry's; fsync each file that matches."""
        if self.failed is not None:
            raise self.failed
        for (k, name), fd in self.fds.items():
            entry = next(f for f in streams[k].files if f.name == name)
            if self.crcs[(k, name)] != entry.crc32c:
                raise CorruptDataError(
                    f"{name} from rank {streams[k].peer}: CRC32C "
                    f"{checksum.to_hex(self.crcs[(k, name)])} != manifest "
                    f"{checksum.to_hex(entry.crc32c)} (damaged in the sender's RAM or in "
                    "transit); not committed")
            os.fsync(fd)

    def close(self) -> None:
        """Close every file opened (once, when the transfer ends either way)."""
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def _read(path: Path, offset: int, length: int) -> torch.Tensor:
    buf = torch.empty(length, dtype=torch.uint8)
    view, done = buf.numpy().data.cast("B"), 0
    with open(path, "rb", buffering=0) as f:
        while done < length:
            n = os.preadv(f.fileno(), [view[done:]], offset + done)
            if n <= 0:
                raise CorruptDataError(f"{path} is shorter than its manifest entry")
            done += n
    return buf


def commit_received(tmp: Path, final: Path, committed: mf.Committed, *,
                    file_mode: int) -> None:
    """Commit a directory of received, verified files (replacing an older replica of the
    same step, which a re-saved step after a rollback leaves)."""
    if final.exists():
        fs.remove_tree(final)
    commit_domain(tmp, final, manifest_bytes=committed.manifest_bytes,
                  marker_bytes=committed.marker_bytes, metadata_bytes=None, file_mode=file_mode)
