"""The write half of :class:`~tierckpt.tier2.storage.gcs.GCSStorage`: uploads in either
integrity mode, parallel parts composed into one object, and create-only puts.

Every upload declares the CRC32C the caller computed when the bytes were written (the
object resource's ``crc32c``; in ``md5`` mode also ``md5Hash``). GCS checks a declared
checksum against the bytes it received and refuses the upload on a mismatch, so in
``crc32c`` mode a wrong object never appears. Whatever the mode, the CRC32C the server then
reports for what it stored must equal ours; if it does not (a server that ignores declared
checksums) that generation is deleted and the upload sent again. In ``md5`` mode — chosen
by the probe for such servers — nothing is uploaded to its key directly: the bytes go to a
temporary name (containing :data:`~tierckpt.tier2.storage.base.TMP_MARK`), its reported
MD5 and CRC32C are compared with ours, and only then is it composed into the key.

Large files (above ``single_upload_threshold``; every file in ``md5`` mode) go in parallel
parts to temporary names, each declaring its own CRC32C. The parts' CRC32Cs, combined,
must equal the file's CRC32C from the manifest *before* anything is composed (so a file
that changed since it was written is refused with nothing new visible); then ``compose``
(32 sources per request, in a tree above that) builds the object, whose reported CRC32C
must equal the manifest's, and the parts are deleted. Create-only puts use
``ifGenerationMatch=0``; a precondition failure is settled by reading the object back.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import uuid
from collections.abc import Callable

from google.api_core import exceptions as gexc
from google.cloud import storage

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import IntegrityMode
from tierckpt.tier2.storage.base import TMP_MARK, BadDigestError, ObjectExistsError, ObjectInfo
from tierckpt.tier2.storage.gcsbase import SDK_ERRORS, GCSBase
from tierckpt.tier2.storage.gcsclient import (
    MAX_COMPONENTS,
    MAX_COMPOSE,
    MiB,
    call,
    convert,
    crc_of,
)

Reader = Callable[[int, int], bytes]
"""``read(offset, length)``: exactly those bytes of what is being uploaded."""


def _pread_full(fd: int, offset: int, length: int) -> bytes:
    chunks, got = [], 0
    while got < length:
        data = os.pread(fd, length - got, offset + got)
        if not data:
            raise StorageError(f"file shrank while uploading (short read at {offset + got})")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _b64_md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


class GCSWrites(GCSBase):
    """The puts of :class:`GCSStorage`."""

    @property
    def _md5(self) -> bool:
        return self.config.integrity == IntegrityMode.MD5.value

    def _send(self, key: str, name: str, data: bytes, crc: int, *,
              create_only: bool = False) -> storage.Blob | None:
        """Upload ``data`` to object ``name`` declaring its CRC32C (and MD5 in md5 mode) and
        return the stored object, after the server's CRC32C (and MD5) of it matched ours.
        A rejected or wrongly stored upload is sent again up to ``digest_attempts`` times
        (a wrongly stored generation is deleted first). With ``create_only`` the upload
        carries ``ifGenerationMatch=0`` and None means it failed that precondition."""
        md5 = _b64_md5(data) if self._md5 else None
        where = f"put {self.url}/{key}"
        for attempt in range(self.config.digest_attempts):
            blob = self._blob(name)
            blob.crc32c = checksum.to_b64(crc)
            if md5 is not None:
                blob.md5_hash = md5
            try:
                call(self.config, functools.partial(
                    blob.upload_from_string, data, content_type="application/octet-stream",
                    checksum=None, retry=None, if_generation_match=0 if create_only else None,
                    timeout=self.config.timeout), self.throttled)
            except gexc.PreconditionFailed:
                if create_only:
                    return None
                raise StorageError(f"{where}: precondition failed (HTTP 412)") from None
            except SDK_ERRORS as e:
                err = convert(where, e)
                if isinstance(err, BadDigestError) and attempt + 1 < self.config.digest_attempts:
                    continue  # the server refused bytes that changed in transit: send again
                raise err from None
            stored = crc_of(blob.crc32c)
            if stored is None:
                self._delete_name(key, name, blob.generation)
                raise StorageError(f"{where}: the store reports no CRC32C for what it stored; "
                                   "it cannot be verified end to end")
            if stored == crc and (md5 is None or blob.md5_hash == md5):
                return blob
            self._delete_name(key, name, blob.generation)  # ours, and wrong: never leave it
        raise BadDigestError(f"{where}: the server stored other bytes than were sent "
                             f"({self.config.digest_attempts} tries)")

    # -- puts ---------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        full = self._name(key)
        data = bytes(data)
        crc = checksum.extend(0, data)
        info = ObjectInfo(key=key, size=len(data), crc32c=crc)
        if if_none_match:
            if self._send(key, full, data, crc, create_only=True) is None:
                if self._get_or_none(key) == data:
                    return info  # ours, from an attempt whose response was lost
                raise ObjectExistsError(
                    f"create-only put {self.url}/{key}: a different object exists")
        elif self._md5:
            self._put_parts(key, full, lambda off, n: data[off:off + n], crc, len(data))
        else:
            self._send(key, full, data, crc)
        return info

    def put_file(self, key: str, path: str | os.PathLike[str], *, crc32c: int,
                 size: int) -> ObjectInfo:
        full = self._name(key)
        try:
            actual = os.stat(path).st_size
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise StorageError(f"put {self.url}/{key}: cannot read {path}: {e.strerror}") from e
        try:
            if actual != size:
                raise BadDigestError(f"put {self.url}/{key}: {path} has {actual} bytes, "
                                     f"expected {size}")
            read: Reader = lambda off, n: _pread_full(fd, off, n)  # noqa: E731
            if self._md5 or size > self.config.single_upload_threshold:
                self._put_parts(key, full, read, crc32c, size)
            else:
                self._send(key, full, read(0, size), crc32c)
        finally:
            os.close(fd)
        return ObjectInfo(key=key, size=size, crc32c=crc32c)

    # -- parts and compose --------------------------------------------------------------
    def _put_parts(self, key: str, full: str, read: Reader, crc32c: int, size: int) -> None:
        """Upload ``size`` bytes from ``read`` in parallel parts to temporary names, check
        their combined CRC32C against ``crc32c``, compose them into ``full``, check its
        reported CRC32C and size, and delete the parts (also on failure)."""
        where = f"put {self.url}/{key}"
        part = max(self.config.part_size, -(-size // (MAX_COMPONENTS * MiB)) * MiB)
        ranges = [(off, min(part, size - off)) for off in range(0, size, part)] or [(0, 0)]
        tmp = f"{full}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        temps = [f"{tmp}.{i:05d}" for i in range(len(ranges))]

        def send_part(i: int) -> tuple[storage.Blob, int]:
            off, n = ranges[i]
            data = read(off, n)
            crc = checksum.extend(0, data)
            blob = self._send(key, temps[i], data, crc)
            assert blob is not None
            return blob, crc

        try:
            sent = self._parallel(list(range(len(ranges))), send_part)
            got = 0
            for (_off, n), (_blob, crc) in zip(ranges, sent, strict=True):
                got = checksum.combine(got, crc, n)
            if got != crc32c:
                raise BadDigestError(f"{where}: the file's bytes have crc32c "
                                     f"{checksum.to_hex(got)}, expected "
                                     f"{checksum.to_hex(crc32c)} (changed since it was written)")
            final = self._compose(key, full, [b for b, _ in sent], tmp, temps)
            stored = crc_of(final.crc32c)
            if stored != crc32c or int(final.size or 0) != size:
                self._delete_name(key, full, final.generation)
                raise BadDigestError(f"{where}: the composed object has crc32c "
                                     f"{checksum.to_hex(stored or 0)} and {final.size} bytes, "
                                     f"expected {checksum.to_hex(crc32c)} and {size}")
        finally:
            self._parallel(temps, lambda name: self._delete_quietly(key, [name]))

    def _compose(self, key: str, full: str, sources: list[storage.Blob], tmp: str,
                 temps: list[str]) -> storage.Blob:
        """Compose ``sources`` (in order) into ``full``: in one request up to 32 sources,
        else first into intermediate temporaries (named in ``temps`` for cleanup)."""
        level = 0
        while len(sources) > MAX_COMPOSE:
            groups = [sources[i:i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
            names = [f"{tmp}.c{level}-{j:04d}" for j in range(len(groups))]
            temps.extend(names)
            sources = self._parallel(list(zip(names, groups, strict=True)),
                                     lambda ng: self._compose_one(key, ng[0], ng[1]))
            level += 1
        return self._compose_one(key, full, sources)

    def _compose_one(self, key: str, name: str, sources: list[storage.Blob]) -> storage.Blob:
        """One compose request; each source pinned to the generation we uploaded (and
        required to still be it), so only our verified parts can end up in ``name``."""
        dest = self._blob(name)
        dest.content_type = "application/octet-stream"
        gens = [s.generation for s in sources]
        self._call("compose", key, lambda: dest.compose(
            sources, if_source_generation_match=gens, timeout=self.config.timeout,
            retry=None))
        return dest
