"""Open one committed checkpoint for reading by byte range: from a tier-1 root, a step
directory or a tier-2 URL.

Contract: only a *committed* checkpoint is ever opened — its marker and manifest are read
(bounded) and verified (digest, signature when ``TIERCKPT_SIGNING_KEY`` is set, step)
before anything else. DCP's ``.metadata`` is then read whole, checked against the
manifest's CRC32C and unpickled with the restricted unpickler
(:func:`tierckpt.restore.metadata.load_metadata`): no code in a checkpoint ever runs.
Everything else is read by byte range (:meth:`Checkpoint.read_range`), verified by the
caller against the per-record CRC32Cs (the manifest's, or the writer's records file:
:meth:`Checkpoint.entry`; :mod:`tierckpt.share.ranged`).

With ``step="latest"`` the newest committed checkpoint is chosen, as ``restore()`` does:
a candidate whose marker or manifest fails is skipped with a logged reason (listed in
:attr:`Checkpoint.skipped`), a partial one (no marker) is never considered. A tier-1
checkpoint being read is pinned (best effort), so the job's retention keeps it meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from tierckpt.errors import (
    CheckpointError,
    ConfigError,
    CorruptDataError,
    IntegrityError,
    NoCheckpointError,
    StorageError,
)
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.format.records import ChunkIndex
from tierckpt.restore.metadata import load_metadata
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.manifests import read_committed
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import Storage, open_storage
from tierckpt.tier2.storage.base import ByteCounter
from tierckpt.tier2.storage.url import FORMS

_log = logging.getLogger("tierckpt")

Step = int | str
"""A step number, or ``"latest"``: the newest committed checkpoint."""


@dataclasses.dataclass
class Checkpoint:
    """One committed checkpoint, open for ranged reads. Close it (or use ``with``)."""

    step: int
    tier: str
    """``"tier1"`` (a directory) or ``"tier2"`` (an object store)."""
    location: str
    """Where it is, safe to print (a path, or ``s3://bucket/prefix`` + the step)."""
    manifest: mf.Manifest
    skipped: tuple[tuple[int, str], ...]
    """Newer candidates that did not verify, with the reason, newest first."""
    _read: Callable[[str, int, int], bytes]
    _close: Callable[[], None]
    _reads: ByteCounter = dataclasses.field(default_factory=ByteCounter)
    _metadata: Metadata | None = None
    _index: ChunkIndex | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes read from the checkpoint's files so far (manifest and marker included)."""
        return self._reads.value

    def entry(self, name: str) -> mf.FileEntry:
        """The manifest entry of file ``name``, its per-record CRC32Cs filled in from its
        writer's records file (read once per rank, checked against the manifest) when the
        manifest does not list them inline; IntegrityError when it lists no such file."""
        try:
            return self.chunk_index.entry(name)
        except KeyError:
            raise IntegrityError(f"{self.location}: .metadata names {name!r}, which the "
                                 "manifest does not list") from None

    @property
    def chunk_index(self) -> ChunkIndex:
        """The per-record CRC32Cs of this checkpoint's files (:mod:`tierckpt.format.records`)."""
        if self._index is None:
            self._index = ChunkIndex(self.manifest, self.read_whole, location=self.location)
        return self._index

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of file ``name`` (unverified: check them
        against the manifest)."""
        entry = self.entry(name)
        if offset < 0 or length < 0 or offset + length > entry.size:
            raise IntegrityError(f"{self.location}/{name}: range {offset}+{length} lies "
                                 f"outside the file ({entry.size} bytes in the manifest)")
        data = self._read(name, offset, length)
        self._reads.add(len(data))
        return data

    def read_whole(self, name: str) -> bytes:
        """All of file ``name``, checked against the manifest's size and CRC32C."""
        entry = self.entry(name)
        data = self.read_range(name, 0, entry.size)
        if checksum.extend(0, data) != entry.crc32c:
            raise CorruptDataError(f"{self.location}/{name}: CRC32C does not match the "
                                   "manifest (damaged or replaced)")
        return data

    def metadata(self) -> Metadata:
        """DCP's metadata, CRC-checked and unpickled with the restricted unpickler."""
        if self._metadata is None:
            data = self.read_whole(layout.METADATA)
            self._metadata = load_metadata(data, source=f"{self.location}/{layout.METADATA}")
        return self._metadata

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(source: str | os.PathLike[str], *, step: Step = "latest") -> Checkpoint:
    """Open the checkpoint ``step`` (or the newest committed one) at ``source``: a tier-1
    root, one step directory (``.../step-00000100``), or a tier-2 URL (``s3://…``,
    ``gs://…``, ``az://…``, ``file://…``). Raises :class:`NoCheckpointError` when there is
    none (saying why each candidate was skipped), :class:`ConfigError` for a source that is
    none of these."""
    wanted = _parse_step(step)
    text = os.fspath(source)
    if "://" in text:
        return _open_tier2(open_storage(text), wanted)
    path = Path(text)
    if not path.is_dir():
        raise ConfigError(f"{text!r} is not a directory or a tier-2 URL: pass a tier-1 root, "
                          f"a step directory (step-XXXXXXXX) or a tier-2 URL ({FORMS})")
    if (path / layout.MANIFEST).exists() or (path / layout.COMPLETE).exists():
        return _open_dir(path, wanted)
    return _open_tier1(Tier1Catalog(path), wanted)


def _parse_step(step: Step) -> int | None:
    if step == "latest":
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int or 'latest', got {step!r}")
    return step


def _choose(steps: list[int], wanted: int | None, open_one: Callable[[int], Checkpoint],
            where: str) -> Checkpoint:
    """The newest of ``steps`` (or ``wanted``) whose marker, manifest and ``.metadata``
    verify; each one that does not is skipped with its reason (logged, and listed in
    :attr:`Checkpoint.skipped`)."""
    if wanted is not None:
        if wanted not in steps:
            raise NoCheckpointError(f"{where} has no complete checkpoint at step {wanted} "
                                    f"(complete: {steps[-8:] or 'none'})")
        steps = [wanted]
    skipped: list[tuple[int, str]] = []
    for s in sorted(steps, reverse=True):
        try:
            ckpt = open_one(s)
        except (IntegrityError, StorageError, OSError) as e:
            if wanted is not None:
                raise
            _log.warning("%s: step %d skipped: %s", where, s, e)
            skipped.append((s, str(e)))
            continue
        try:
            ckpt.metadata()
        except (IntegrityError, StorageError, OSError) as e:
            ckpt.close()
            if wanted is not None:
                raise
            _log.warning("%s: step %d skipped: %s", where, s, e)
            skipped.append((s, str(e)))
            continue
        ckpt.skipped = tuple(skipped)
        return ckpt
    why = "; ".join(f"step {s}: {r}" for s, r in skipped) or "no COMPLETE marker anywhere"
    raise NoCheckpointError(f"{where} has no committed checkpoint to read ({why})")


def _open_dir(path: Path, wanted: int | None) -> Checkpoint:
    committed = read_committed(path, step=layout.parse_step_dirname(path.name))
    if wanted is not None and committed.manifest.step != wanted:
        raise NoCheckpointError(f"{path} holds step {committed.manifest.step}, not {wanted}")
    ckpt = _local(path, committed, lambda: None)
    ckpt.metadata()
    return ckpt


def _open_tier1(cat: Tier1Catalog, wanted: int | None) -> Checkpoint:
    def open_one(step: int) -> Checkpoint:
        committed = cat.read_committed(step)
        holder = f"reader-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        pinned = False
        with contextlib.suppress(OSError):  # a read-only root can still be read
            cat.pin(step, holder)
            pinned = True

        def unpin() -> None:
            if pinned:
                with contextlib.suppress(OSError):
                    cat.unpin(step, holder)

        return _local(cat.step_dir(step), committed, unpin)

    return _choose(cat.complete_steps(), wanted, open_one, f"tier-1 root {cat.root}")


def _local(path: Path, committed: mf.Committed, close: Callable[[], None]) -> Checkpoint:
    def read(name: str, offset: int, length: int) -> bytes:
        try:
            with open(path / layout.safe_member_name(name), "rb", buffering=0) as f:
                buf = bytearray(length)
                view, done = memoryview(buf), 0
                while done < length:
                    n = os.preadv(f.fileno(), [view[done:]], offset + done)
                    if n <= 0:
                        raise IntegrityError(f"{path}/{name}: shorter than the manifest says")
                    done += n
                return bytes(buf)
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}/{name} is missing: this tier-1 root holds only its own node's "
                "shards (node-local tier 1) or the file was removed; read the checkpoint "
                "from tier 2 or from the root that has it") from None

    ckpt = Checkpoint(step=committed.manifest.step, tier="tier1", location=str(path),
                      manifest=committed.manifest, skipped=(), _read=read, _close=close)
    ckpt._reads.add(len(committed.manifest_bytes) + len(committed.marker_bytes))
    return ckpt


def _open_tier2(storage: Storage, wanted: int | None) -> Checkpoint:
    cat = Tier2Catalog(storage)

    def open_one(step: int) -> Checkpoint:
        where = cat.resolve(step)  # content-addressed steps: through their object map
        committed = where.committed

        def read(name: str, offset: int, length: int) -> Any:
            return storage.get_range(where.key(name), offset, length)

        ckpt = Checkpoint(step=step, tier="tier2",
                          location=f"{storage.url}/{layout.step_dirname(step)}",
                          manifest=committed.manifest, skipped=(), _read=read,
                          _close=lambda: None)
        ckpt._reads.add(len(committed.manifest_bytes) + len(committed.marker_bytes))
        return ckpt

    try:
        ckpt = _choose(cat.complete_steps(), wanted, open_one, f"tier 2 {storage.url}")
    except BaseException:
        storage.close()
        raise
    ckpt._close = storage.close
    return ckpt
