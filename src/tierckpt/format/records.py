"""Each rank's per-record CRC32Cs, in a file of its own (``__<rank>.records``). Pure but for
the reads a caller hands in.

A shard file's records (one per DCP item) each have a CRC32C, so a reader that fetches one
tensor's byte range can verify just that range. The manifest used to list them inline,
which made it grow with ranks × tensors (~94 KiB per rank for a Llama-70B state: 386 MiB
at 4,096 ranks, parsed whole by every restoring rank). Since the rank files, the manifest
lists each shard file with its size and whole-file CRC32C only, plus one records file per
rank (itself listed with its size and CRC32C), and the per-record CRC32Cs live there:

.. code-block:: json

    {"format_version": 1, "rank": 3, "files": {"__3_0.distcp": [[0, 1234, "9ab0c1d2"], ...]}}

A reader that checks records one by one (a reshard, a ranged read from tier 2) loads the
records file of the rank that wrote the file (:class:`ChunkIndex`), after checking it
against the manifest; a rank that reads its own file whole checks the whole-file CRC32C
and never opens it. Manifests from before list the chunks inline, which still wins.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable

from tierckpt.errors import IntegrityError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf

FORMAT_VERSION = 1


def to_bytes(rank: int, files: Iterable[mf.FileEntry]) -> bytes:
    """The records file of ``rank`` for its shard ``files`` (their ``chunks``)."""
    body = {"format_version": FORMAT_VERSION, "rank": rank,
            "files": {f.name: [[c.offset, c.length, checksum.to_hex(c.crc32c)]
                               for c in f.chunks] for f in files}}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n"


def parse(data: bytes, manifest: mf.Manifest, *, rank: int, source: str
          ) -> dict[str, tuple[mf.Chunk, ...]]:
    """File name → its chunks, from a records file already checked against the manifest.
    Each listed file must be one of ``rank``'s in ``manifest``, its chunks in order and
    inside it; anything else is an :class:`IntegrityError` naming ``source``."""
    try:
        body = json.loads(data.decode("utf-8"))
        if not isinstance(body, dict) or body.get("format_version") != FORMAT_VERSION \
                or body.get("rank") != rank or not isinstance(body.get("files"), dict):
            raise ValueError(f"not a format-{FORMAT_VERSION} records file of rank {rank}")
        out: dict[str, tuple[mf.Chunk, ...]] = {}
        for name, raw in body["files"].items():
            entry = manifest.file(layout.safe_member_name(str(name)))
            if entry.rank != rank:
                raise ValueError(f"it lists {name}, which rank {entry.rank} wrote")
            out[entry.name] = mf.FileEntry.from_json(
                {**entry.to_json(), "chunks": raw}).chunks
        return out
    except IntegrityError as e:
        raise IntegrityError(f"{source}: {e}") from e
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{source}: malformed records file ({e})") from e


class ChunkIndex:
    """Per-record CRC32Cs of one checkpoint's files, loaded lazily: ``read(name)`` returns
    the bytes of a member file (the caller's I/O: a directory, a bucket). A records file is
    checked against the manifest's size and CRC32C before it is parsed. Thread-safe."""

    def __init__(self, manifest: mf.Manifest, read: Callable[[str], bytes], *,
                 location: str = "") -> None:
        self.manifest, self._read, self.location = manifest, read, location
        self._by_rank: dict[int, dict[str, tuple[mf.Chunk, ...]]] = {}
        self._by_range: dict[str, dict[tuple[int, int], mf.Chunk]] = {}
        self._lock = threading.Lock()
        self.loaded: list[str] = []
        """Records files read so far, in order."""

    def has_chunks(self, name: str) -> bool:
        """Whether file ``name``'s records can be checked one by one (inline chunks, or a
        records file of its rank), without reading anything."""
        entry = self.manifest.file(name)
        return bool(entry.chunks) or (entry.rank is not None and _is_shard(name)
                                      and self._records_entry(entry.rank) is not None)

    def chunks(self, name: str) -> tuple[mf.Chunk, ...]:
        """File ``name``'s chunks: inline in the manifest, else from its rank's records
        file (read once); () when neither has them. Raises :class:`IntegrityError` when
        the records file fails its check."""
        entry = self.manifest.file(name)
        if entry.chunks or entry.rank is None or not _is_shard(name):
            return entry.chunks
        rec = self._records_entry(entry.rank)
        if rec is None:
            return ()
        with self._lock:
            if entry.rank not in self._by_rank:
                data = self._read(rec.name)
                where = f"{self.location}/{rec.name}" if self.location else rec.name
                crc = checksum.extend(0, data)
                if len(data) != rec.size or crc != rec.crc32c:
                    raise IntegrityError(
                        f"{where}: {len(data)} bytes with CRC32C {checksum.to_hex(crc)}, the "
                        f"manifest says {rec.size} bytes with {checksum.to_hex(rec.crc32c)}")
                self._by_rank[entry.rank] = parse(data, self.manifest, rank=entry.rank,
                                                  source=where)
                self.loaded.append(rec.name)
            return self._by_rank[entry.rank].get(name, ())

    def record(self, name: str, offset: int, length: int) -> mf.Chunk | None:
        """The chunk of file ``name`` with exactly this range, or None: O(1) after the
        file's first lookup (``FileEntry.chunk`` scans)."""
        found = self._by_range.get(name)
        if found is None:
            found = {(c.offset, c.length): c for c in self.chunks(name)}
            with self._lock:
                self._by_range[name] = found
        return found.get((offset, length))

    def entry(self, name: str) -> mf.FileEntry:
        """The manifest's entry of ``name`` with its chunks filled in (see :meth:`chunks`)."""
        entry = self.manifest.file(name)
        if entry.chunks or entry.rank is None or not _is_shard(name):
            return entry
        chunks = self.chunks(name)
        return entry if not chunks else mf.FileEntry(
            name=entry.name, size=entry.size, crc32c=entry.crc32c, rank=entry.rank,
            chunks=chunks)

    def _records_entry(self, rank: int) -> mf.FileEntry | None:
        try:
            return self.manifest.file(layout.rank_records_filename(rank))
        except KeyError:
            return None


def _is_shard(name: str) -> bool:
    """Only DCP shard files have records in a records file (never the small files)."""
    return layout.shard_rank(name) is not None
