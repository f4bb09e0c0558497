"""Where a tensor's raw bytes sit inside a ``torch.save`` record — pure ``struct``, no torch.

``torch.save`` writes a zip archive (``archive/data.pkl``, ``archive/byteorder``,
``archive/data/0`` …) with every entry stored uncompressed; DCP writes one such archive per
item into a shard file. When the archive holds exactly one storage entry of the tensor's
byte size, those bytes are the tensor itself and can be read straight into a destination
(:mod:`tierckpt.restore.reader`) or viewed in place (:mod:`tierckpt.share.ranged`) instead of
going through ``torch.load``. This module finds them from the archive's end records and
central directory (zip64 included) and one local header: two small reads per record, no
``zipfile`` object. Anything unexpected answers None and the caller takes the general path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

_EOCD = struct.Struct("<IHHHHIIH")              # end of central directory, 22 bytes
_EOCD_SIG = b"PK\x05\x06"
_LOCATOR = struct.Struct("<IIQI")               # zip64 end-of-central-directory locator
_LOCATOR_SIG = 0x07064B50
_EOCD64 = struct.Struct("<IQHHIIQQQQ")          # zip64 end of central directory, 56 bytes
_EOCD64_SIG = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")   # central directory header, 46 bytes
_CENTRAL_SIG = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")          # local file header, 30 bytes
_LOCAL_SIG = 0x04034B50
_ZIP64_EXTRA = 0x0001
_STORED = 0
_TAIL = 4096  # the end records and a one-storage central directory fit in this
_HEAD = 1024  # a local header and its name and extra field (alignment padding) fit in this

Read = Callable[[int, int], bytes | memoryview]
"""``read(offset, n)``: up to ``n`` bytes of the record from ``offset`` (record-relative)."""


def tensor_data_offset(read: Read, length: int, nbytes: int) -> int | None:
    """Record-relative offset of the one stored storage entry of ``nbytes`` bytes in the
    ``torch.save`` archive of ``length`` bytes that ``read`` returns; None when the record
    is not such an archive (several storages, compressed, other sizes, malformed)."""
    try:
        entry = _storage_entry(read, length)
    except (struct.error, ValueError):
        return None
    if entry is None:
        return None
    method, size, local = entry
    if method != _STORED or size != nbytes or local + _LOCAL.size > length:
        return None
    head = bytes(read(local, min(_HEAD, length - local)))
    if len(head) < _LOCAL.size:
        return None
    fields = _LOCAL.unpack_from(head)
    if fields[0] != _LOCAL_SIG:
        return None
    start = local + _LOCAL.size + fields[9] + fields[10]
    return start if start + nbytes <= length else None


def _storage_entry(read: Read, length: int) -> tuple[int, int, int] | None:
    """``(method, compressed size, local header offset)`` of the archive's only entry
    under ``<archive>/data/``, or None when there is not exactly one."""
    tail_start = max(0, length - _TAIL)
    tail = bytes(read(tail_start, length - tail_start))
    at = tail.rfind(_EOCD_SIG)
    if at < 0 or at + _EOCD.size > len(tail):
        return None
    (_, _, _, _, count, cd_size, cd_offset, _) = _EOCD.unpack_from(tail, at)
    if 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF:
        loc = at - _LOCATOR.size
        if loc < 0:
            return None
        sig, _, eocd64, _ = _LOCATOR.unpack_from(tail, loc)
        if sig != _LOCATOR_SIG:
            return None
        rec = _slice(read, tail, tail_start, eocd64, _EOCD64.size)
        fields = _EOCD64.unpack_from(rec)
        if fields[0] != _EOCD64_SIG:
            return None
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
    if cd_offset + cd_size > length:
        return None
    cd = _slice(read, tail, tail_start, cd_offset, cd_size)
    found: list[tuple[int, int, int]] = []
    pos = 0
    for _ in range(count):
        f = _CENTRAL.unpack_from(cd, pos)
        if f[0] != _CENTRAL_SIG:
            return None
        name_len, extra_len, comment_len = f[10], f[11], f[12]
        name = cd[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len].decode("utf-8", "replace")
        extra = cd[pos + _CENTRAL.size + name_len:pos + _CENTRAL.size + name_len + extra_len]
        if name.split("/", 1)[-1].startswith("data/"):
            size, local = _zip64_sizes(extra, usize=f[9], csize=f[8], local=f[16])
            found.append((f[4], size, local))
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return found[0] if len(found) == 1 else None


def _zip64_sizes(extra: bytes, *, usize: int, csize: int, local: int) -> tuple[int, int]:
    """``(compressed size, local header offset)``, taking the zip64 extra field's values for
    the fields that are 0xFFFFFFFF (in the order the format lists them)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_EXTRA:
            body, at = extra[pos + 4:pos + 4 + size], 0
            if usize == 0xFFFFFFFF:
                usize, at = struct.unpack_from("<Q", body, at)[0], at + 8
            if csize == 0xFFFFFFFF:
                csize, at = struct.unpack_from("<Q", body, at)[0], at + 8
            if local == 0xFFFFFFFF:
                local = struct.unpack_from("<Q", body, at)[0]
            break
        pos += 4 + size
    if 0xFFFFFFFF in (csize, local):
        raise ValueError("zip64 sizes missing from the extra field")
    return csize, local


def _slice(read: Read, tail: bytes, tail_start: int, offset: int, n: int) -> bytes:
    """``n`` bytes at ``offset``: from the tail already read when it holds them."""
    if offset >= tail_start and offset + n <= tail_start + len(tail):
        return tail[offset - tail_start:offset - tail_start + n]
    got = bytes(read(offset, n))
    if len(got) != n:
        raise ValueError("short read")
    return got
