"""The commit of one save, after every rank wrote its files: rank 0 seals, owners commit.

:meth:`Committer.commit` is collective, in this order on every rank: (1) rank 0 builds the
manifest from the file lists the write gathered and seals it with its marker, and
broadcasts an O(1) status (the first rank's write error, or the checkpoint's bytes);
(2) the domain owners receive the manifest, marker and ``.metadata`` over their own group
(O(W) each, and only they); (3) each owner runs :func:`commit.commit_domain` into its
tier's final name; (4) every rank agrees on the first error. Any failure raises
:class:`SaveError` on every rank.

Owners keep the ``.metadata`` they last committed: while every owner holds the bytes a
save needs (their SHA-256 came with the gather), rank 0 sends the digest in their place,
so a steady save sends the owners O(W) bytes, not the O(W × tensors) ``.metadata``.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import NamedTuple

import torch

from tierckpt._version import __version__
from tierckpt.errors import SaveError
from tierckpt.format import manifest as mf
from tierckpt.format.parts import Sealed, rebuild_parts, seal
from tierckpt.runtime.topology import Comm
from tierckpt.save.coordinate import Written
from tierckpt.save.writer import ShardWriter
from tierckpt.tier1.commit import commit_domain

Payload = tuple[bytes, bytes, bytes | None, bytes]
"""What owners receive: manifest bytes, marker bytes, the ``.metadata`` bytes (None: the
owner holds them) and the ``.metadata``'s SHA-256."""


class Outcome(NamedTuple):
    """What a commit leaves a rank: the manifest and the verified bytes it committed
    (owners; None on the other ranks) and the checkpoint's total bytes (every rank)."""

    manifest: mf.Manifest | None
    committed: mf.Committed | None
    total: int


class Committer:
    """The commit protocol of :class:`AsyncSaver`, with what owners hold between saves.
    Construction is collective (the owners' group)."""

    def __init__(self, comm: Comm, domains: tuple[tuple[int, ...], ...], *,
                 file_mode: int) -> None:
        self.comm, self.domains, self.file_mode = comm, domains, file_mode
        self.is_owner = any(d[0] == comm.rank for d in domains)
        self.held: tuple[bytes, bytes] | None = None
        """Owners: (SHA-256, bytes) of the ``.metadata`` this rank last committed."""
        self._digest: tuple[bytes, bytes] | None = None
        """Rank 0: (bytes, SHA-256) of the last ``.metadata`` digested (the same object
        while the coordinator reuses it, so it is hashed once per change)."""
        self._owners = comm.subgroup(tuple(d[0] for d in domains))  # collective

    @property
    def held_digest(self) -> bytes | None:
        """The SHA-256 of the ``.metadata`` this owner holds (None: it holds none)."""
        return self.held[0] if self.held is not None else None

    def commit(self, step: int, save_id: str, writer: ShardWriter, written: Written,
               tmp: Path, final: Path) -> Outcome:
        """Collective: commit the save of ``step`` written into ``tmp`` as ``final`` (both
        in one tier's root). Raises :class:`SaveError` on every rank when a rank's write
        or an owner's commit failed."""
        status: tuple[str | None, int] | None = None
        payload: Payload | None = None
        sealed: Sealed | None = None
        if self.comm.rank == 0:
            status, payload, sealed = self._seal(step, save_id, writer, written)
        failed, total = self.comm.broadcast(status)  # O(1): the error, or the bytes
        if failed is not None:
            raise SaveError(f"save of step {step} failed: {failed}") from written.exception
        if self._owners is not None:  # the manifest goes to domain owners only (O(W) each)
            payload = self._owners.broadcast(payload)
        error, manifest = None, None
        if self.is_owner:
            assert payload is not None
            manifest, error = self._commit_domain(step, payload, sealed, tmp, final)
        failed = self.comm.first_error(error)
        if failed is not None:
            raise SaveError(failed)
        committed = mf.Committed(manifest, payload[0], payload[1]) \
            if manifest is not None and payload is not None else None
        return Outcome(manifest, committed, total)

    def _seal(self, step: int, save_id: str, writer: ShardWriter, written: Written
              ) -> tuple[tuple[str | None, int], Payload | None, Sealed | None]:
        """Rank 0: the status to broadcast and, when every rank wrote, the owners' payload
        and the sealed manifest."""
        assert written.all_files is not None and written.all_errors is not None
        first = next((e for e in written.all_errors if e), None)
        if first is not None:
            return (first, 0), None, None
        assert writer.metadata_entry is not None and writer.metadata_bytes is not None
        files = (*(f for fl in written.all_files for f in fl), writer.metadata_entry)
        sealed = seal(mf.Manifest(
            step=step, world_size=self.comm.world_size, save_id=save_id,
            files=files, domains=self.domains, created_unix=time.time(),
            torch_version=torch.__version__, tierckpt_version=__version__),
            mf.signing_key())
        digest = self._digest_of(writer.metadata_bytes)
        assert written.all_held is not None
        held_by_all = all(written.all_held[d[0]] == digest for d in self.domains)
        payload = (sealed.manifest_bytes, sealed.marker_bytes,
                   None if held_by_all else writer.metadata_bytes, digest)
        return (None, sealed.manifest.total_bytes), payload, sealed

    def _commit_domain(self, step: int, payload: Payload, sealed: Sealed | None,
                       tmp: Path, final: Path) -> tuple[mf.Manifest | None, str | None]:
        """Owners: commit this domain's directory; the manifest and an error, if any (as
        text, for every rank)."""
        mbytes, marker, meta_bytes, digest = payload
        manifest = None
        try:
            manifest = mf.Manifest.from_bytes(mbytes)
            if meta_bytes is None:  # rank 0 saw in the gather that this owner holds them
                if self.held is None or self.held[0] != digest:
                    raise SaveError("rank 0 sent the digest of a .metadata this owner "
                                    "does not hold")
                meta_bytes = self.held[1]
            # rank 0 sealed the manifest; other owners rebuild its parts from it
            parts = sealed.parts if sealed is not None else rebuild_parts(manifest)
            commit_domain(tmp, final, manifest_bytes=mbytes, marker_bytes=marker,
                          metadata_bytes=meta_bytes, file_mode=self.file_mode, parts=parts)
            self.held = (digest, meta_bytes)
        except Exception as e:
            return manifest, (f"rank {self.comm.rank}: commit of step {step} in "
                              f"{tmp.parent} failed: {e}")
        return manifest, None

    def _digest_of(self, data: bytes) -> bytes:
        if self._digest is None or self._digest[0] is not data:
            self._digest = (data, hashlib.sha256(data).digest())
        return self._digest[1]

