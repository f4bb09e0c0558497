"""An in-memory object store for tests, with deterministic fault injection.

It honours the whole :class:`~tierckpt.tier2.storage.base.Storage` contract (one lock makes
every operation atomic) and adds two test hooks: :meth:`MemoryStorage.inject` makes the
next N calls of an operation fail (before or after taking effect, the latter being "stored
but the caller saw an error"), and :meth:`MemoryStorage.corrupt` flips a stored byte while
keeping the recorded checksum (bit rot at rest).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

from tierckpt.errors import StorageError
from tierckpt.format import checksum
from tierckpt.tier1.fs import write_durably
from tierckpt.tier2.storage.base import (
    BadDigestError,
    ByteCounter,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    check_range,
    validate_key,
    validate_prefix,
)

OPS = ("put_file", "put_bytes", "get_file", "get_bytes", "get_range", "head", "list",
       "delete")


@dataclasses.dataclass
class _Fault:
    op: str
    times: int
    after: bool
    key_contains: str
    error: Exception | None


class MemoryStorage:
    """A :class:`~tierckpt.tier2.storage.base.Storage` holding objects in a dict (per instance)."""

    integrity = "crc32c"  # every byte is checked against its CRC32C by this backend

    def __init__(self, name: str = "mem") -> None:
        self.url = f"memory://{name}"
        self._objects: dict[str, tuple[bytes, int]] = {}
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self.calls: dict[str, int] = dict.fromkeys(OPS, 0)
        """How many times each operation was called (faulted calls included)."""
        self._reads = ByteCounter()

    @property
    def bytes_read(self) -> int:
        return self._reads.value

    def __repr__(self) -> str:
        return f"MemoryStorage({self.url!r})"

    # -- test hooks ---------------------------------------------------------------------
    def inject(self, op: str, *, times: int = 1, after: bool = False, key_contains: str = "",
               error: Exception | None = None) -> None:
        """Make the next ``times`` calls of ``op`` (on keys containing ``key_contains``)
        raise ``error`` (default: a StorageError). With ``after=True`` the operation takes
        effect first, then raises: the caller cannot tell it succeeded."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        with self._lock:
            self._faults.append(_Fault(op, times, after, key_contains, error))

    def corrupt(self, key: str, offset: int = 0) -> None:
        """Flip one byte of a stored object, keeping its recorded CRC32C."""
        with self._lock:
            data, crc = self._objects[key]
            buf = bytearray(data)
            buf[offset] ^= 0xFF
            self._objects[key] = (bytes(buf), crc)

    def _fault(self, op: str, key: str, after: bool) -> None:
        with self._lock:
            self.calls[op] += 0 if after else 1
            for f in self._faults:
                if f.op == op and f.after == after and f.key_contains in key and f.times > 0:
                    f.times -= 1
                    raise f.error or StorageError(f"injected {op} failure on {self.url}/{key}")

    # -- Storage ------------------------------------------------------------------------
    def _store(self, key: str, data: bytes, crc: int, if_none_match: bool) -> None:
        with self._lock:
            old = self._objects.get(key)
            if if_none_match and old is not None:
                if old[0] != data:
                    raise ObjectExistsError(
                        f"create-only put {self.url}/{key}: a different object exists")
                return
            self._objects[key] = (data, crc)

    def put_file(self, key: str, path: str | os.PathLike[str], *, crc32c: int,
                 size: int) -> ObjectInfo:
        validate_key(key)
        self._fault("put_file", key, after=False)
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise StorageError(f"put {self.url}/{key}: cannot read {path}: {e.strerror}") from e
        crc = checksum.extend(0, data)
        if len(data) != size or crc != crc32c:
            raise BadDigestError(
                f"put {self.url}/{key}: {path} has {len(data)} bytes crc32c "
                f"{checksum.to_hex(crc)}, "
                f"expected {size} bytes crc32c {checksum.to_hex(crc32c)}")
        self._store(key, data, crc, if_none_match=False)
        self._fault("put_file", key, after=True)
        return ObjectInfo(key=key, size=size, crc32c=crc)

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        validate_key(key)
        self._fault("put_bytes", key, after=False)
        data = bytes(data)
        crc = checksum.extend(0, data)
        self._store(key, data, crc, if_none_match)
        self._fault("put_bytes", key, after=True)
        return ObjectInfo(key=key, size=len(data), crc32c=crc)

    def _read(self, op: str, key: str) -> tuple[bytes, int]:
        validate_key(key)
        self._fault(op, key, after=False)
        with self._lock:
            obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        return obj

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        data, stored = self._read("get_file", key)
        want = stored if crc32c is None else crc32c
        if checksum.extend(0, data) != want:
            raise BadDigestError(f"get {self.url}/{key}: bytes do not match crc32c "
                                 f"{checksum.to_hex(want)}")
        dest = Path(path)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_durably(dest, data)
        except OSError as e:
            raise StorageError(f"get {self.url}/{key}: cannot write {path}: {e.strerror}") from e
        self._fault("get_file", key, after=True)
        self._reads.add(len(data))
        return ObjectInfo(key=key, size=len(data), crc32c=want)

    def get_bytes(self, key: str) -> bytes:
        data, stored = self._read("get_bytes", key)
        if checksum.extend(0, data) != stored:
            raise BadDigestError(f"get {self.url}/{key}: bytes do not match stored crc32c")
        self._fault("get_bytes", key, after=True)
        self._reads.add(len(data))
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        data, _stored = self._read("get_range", key)
        if offset + length > len(data):
            raise StorageError(f"get {self.url}/{key}: range {offset}+{length} ends past the "
                               f"object ({len(data)} bytes)")
        self._fault("get_range", key, after=True)
        self._reads.add(length)
        return data[offset:offset + length]

    def head(self, key: str) -> ObjectInfo | None:
        validate_key(key)
        self._fault("head", key, after=False)
        with self._lock:
            obj = self._objects.get(key)
        return None if obj is None else ObjectInfo(key=key, size=len(obj[0]), crc32c=obj[1])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        self._fault("list", prefix, after=False)
        with self._lock:
            items = sorted((k, len(v[0])) for k, v in self._objects.items()
                           if k.startswith(prefix))
        return [ObjectInfo(key=k, size=n) for k, n in items]

    def delete(self, key: str) -> None:
        validate_key(key)
        self._fault("delete", key, after=False)
        with self._lock:
            self._objects.pop(key, None)
        self._fault("delete", key, after=True)

    def abort_uploads(self, prefix: str) -> int:
        """Puts are atomic in memory: there is never an unfinished upload to discard."""
        validate_prefix(prefix)
        return 0

    def close(self) -> None:
        """Nothing to release; the objects stay readable (tests inspect them after)."""

    def __enter__(self) -> MemoryStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
