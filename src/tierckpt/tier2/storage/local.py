"""A directory used as an object store (``file:///path``): a mounted filesystem as tier 2.

Key ``a/b/c`` is the file ``<root>/a/b/c``. Every put writes a temporary file in the
target directory, checks its CRC32C, fsyncs it, renames it into place (create-only puts
hard-link it instead, which fails if the name exists) and fsyncs the directory, so an
object is either absent or complete and durable. The CRC32C is kept in the extended
attribute ``user.tierckpt.crc32c`` where the filesystem supports it, so :meth:`head` can
report it without reading the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier1.fs import fsync_dir
from tierckpt.tier2.storage.base import (
    TMP_MARK,
    BadDigestError,
    ByteCounter,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    check_range,
    validate_key,
    validate_prefix,
)

XATTR = "user.tierckpt.crc32c"
_CHUNK = 4 * 1024 * 1024
_FILE_MODE = 0o640
_DIR_MODE = 0o750


def _tmp_name(final: Path) -> Path:
    return final.with_name(f"{TMP_MARK}{uuid.uuid4().hex}.{final.name}")


def _set_crc(path: Path, crc: int) -> None:
    with contextlib.suppress(OSError):  # filesystems without user xattrs: head reports None
        os.setxattr(path, XATTR, checksum.to_hex(crc).encode("ascii"))


def _get_crc(path: Path) -> int | None:
    try:
        return checksum.from_hex(os.getxattr(path, XATTR).decode("ascii"))
    except (OSError, ValueError):
        return None


def _copy_verified(src: Path, dst_fd: int, crc32c: int | None, size: int | None,
                   what: str) -> tuple[int, int]:
    """Copy ``src`` to ``dst_fd`` computing its CRC32C; raise BadDigestError when it does
    not match the expected ``crc32c``/``size`` (None = not checked). Returns (crc, size)."""
    crc, n = 0, 0
    with open(src, "rb", buffering=0) as f:
        while True:
            data = f.read(_CHUNK)
            if not data:
                break
            crc = checksum.extend(crc, data)
            n += len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(dst_fd, view):]
    if (size is not None and n != size) or (crc32c is not None and crc != crc32c):
        raise BadDigestError(
            f"{what}: got {n} bytes crc32c {checksum.to_hex(crc)}, expected "
            f"{size if size is not None else '?'} bytes crc32c "
            f"{checksum.to_hex(crc32c) if crc32c is not None else '?'}")
    return crc, n


class LocalStorage:
    """A :class:`~tierckpt.tier2.storage.base.Storage` over an existing local directory.

    The root is never created: a missing one is a :class:`ConfigError`, so an unmounted
    network file system is not mistaken for tier 2 (its "verified" uploads would land on
    the local disk under the mount point). Directories below the root are created as needed.

    Atomicity comes from rename/link within one directory plus fsync of file and
    directory; it holds on any POSIX filesystem with atomic rename (not on some network
    filesystems, where the mount's own guarantees apply).
    """

    integrity = "crc32c"  # every byte is checked against its CRC32C by this backend

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        if not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise ConfigError(
                f"file:// tier 2 {str(self.root)!r} {what}; create it (mkdir -p) or mount the "
                "file system it belongs on first (it is never created: an unmounted mount "
                "point must not receive uploads)")
        self.url = self.root.as_uri()
        self._reads = ByteCounter()

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    @property
    def bytes_read(self) -> int:
        return self._reads.value

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _err(self, op: str, key: str, e: OSError) -> StorageError:
        return StorageError(f"{op} {self.url}/{key}: {e.strerror or e}")

    def _require_root(self, key: str) -> None:
        """Refuse a put once the root is gone (a file system unmounted under a running
        job): creating the key's directories would re-create the root on the local disk."""
        if not self.root.is_dir():
            raise StorageError(f"put {self.url}/{key}: the tier-2 directory {str(self.root)!r} "
                               "no longer exists (unmounted?); it is not re-created")

    def _write_tmp(self, final: Path, fill: Callable[[int], object]) -> Path:
        tmp = _tmp_name(final)
        for attempt in range(3):
            final.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
                break
            except FileNotFoundError:  # a concurrent delete removed the empty parent
                if attempt == 2:
                    raise
        try:
            fill(fd)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def put_file(self, key: str, path: str | os.PathLike[str], *, crc32c: int,
                 size: int) -> ObjectInfo:
        final = self._path(key)
        self._require_root(key)
        try:
            tmp = self._write_tmp(final, lambda fd: _copy_verified(
                Path(path), fd, crc32c, size, f"put {self.url}/{key} from {path}"))
            _set_crc(tmp, crc32c)
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except StorageError:
            raise
        except OSError as e:
            raise self._err("put", key, e) from e
        return ObjectInfo(key=key, size=size, crc32c=crc32c)

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> ObjectInfo:
        final = self._path(key)
        self._require_root(key)
        crc = checksum.extend(0, data)

        def fill(fd: int) -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]

        try:
            tmp = self._write_tmp(final, fill)
            _set_crc(tmp, crc)
            if if_none_match:
                try:
                    os.link(tmp, final)  # atomic create-only: fails if the name exists
                except FileExistsError:
                    if final.read_bytes() != data:
                        raise ObjectExistsError(
                            f"create-only put {self.url}/{key}: a different object exists"
                        ) from None
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, final)
            fsync_dir(final.parent)
        except StorageError:
            raise
        except OSError as e:
            raise self._err("put", key, e) from e
        return ObjectInfo(key=key, size=len(data), crc32c=crc)

    def get_file(self, key: str, path: str | os.PathLike[str], *,
                 crc32c: int | None = None) -> ObjectInfo:
        src = self._path(key)
        dest = Path(path)
        want = crc32c if crc32c is not None else _get_crc(src) if src.exists() else None
        try:
            tmp = self._write_tmp(dest, lambda fd: _copy_verified(
                src, fd, want, None, f"get {self.url}/{key}"))
            size = os.stat(tmp).st_size
            got = want if want is not None else checksum.of_file(tmp)[0]
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        except StorageError:
            raise
        except FileNotFoundError as e:
            if not src.exists():
                raise ObjectNotFoundError(f"get {self.url}/{key}: no such object") from e
            raise self._err("get", key, e) from e
        except OSError as e:
            raise self._err("get", key, e) from e
        self._reads.add(size)
        return ObjectInfo(key=key, size=size, crc32c=got)

    def get_bytes(self, key: str) -> bytes:
        src = self._path(key)
        try:
            data = src.read_bytes()
        except FileNotFoundError as e:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object") from e
        except OSError as e:
            raise self._err("get", key, e) from e
        want = _get_crc(src)
        if want is not None and checksum.extend(0, data) != want:
            raise BadDigestError(f"get {self.url}/{key}: bytes do not match stored crc32c")
        self._reads.add(len(data))
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                buf = bytearray(length)
                view, done = memoryview(buf), 0
                while done < length:
                    n = os.preadv(f.fileno(), [view[done:]], offset + done)
                    if n <= 0:
                        raise StorageError(f"get {self.url}/{key}: range {offset}+{length} "
                                           f"ends past the object ({offset + done} bytes)")
                    done += n
        except FileNotFoundError as e:
            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object") from e
        except StorageError:
            raise
        except OSError as e:
            raise self._err("get", key, e) from e
        self._reads.add(length)
        return bytes(buf)

    def head(self, key: str) -> ObjectInfo | None:
        p = self._path(key)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._err("head", key, e) from e
        if not os.path.isfile(p):
            return None
        return ObjectInfo(key=key, size=st.st_size, crc32c=_get_crc(p))

    def _walk(self, prefix: str) -> list[tuple[str, Path]]:
        # Descend only into directories that can hold matching keys.
        out: list[tuple[str, Path]] = []
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            dirnames[:] = [d for d in dirnames if (base + d + "/").startswith(prefix)
                           or prefix.startswith(base + d + "/")]
            for name in filenames:
                key = base + name
                if TMP_MARK not in name and key.startswith(prefix):
                    out.append((key, Path(dirpath) / name))
        return out

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        infos: list[ObjectInfo] = []
        for key, p in self._walk(prefix):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue  # deleted while listing
            if os.path.isfile(p) and not os.path.islink(p):
                infos.append(ObjectInfo(key=key, size=st.st_size))
        return sorted(infos, key=lambda i: i.key)

    def delete(self, key: str) -> None:
        p = self._path(key)
        try:
            os.unlink(p)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err("delete", key, e) from e
        fsync_dir(p.parent)
        # Remove now-empty parent directories (best effort; a concurrent put re-creates).
        parent = p.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    break
                raise self._err("delete", key, e) from e
            parent = parent.parent

    def abort_uploads(self, prefix: str) -> int:
        validate_prefix(prefix)
        n = 0
        for dirpath, _dirs, filenames in os.walk(self.root, followlinks=False):
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                if not name.startswith(TMP_MARK):
                    continue
                real = name[len(TMP_MARK):].split(".", 1)[-1]
                if (base + real).startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(dirpath, name))
                        n += 1
        return n

    def close(self) -> None:
        """Nothing to release; present for the protocol."""

    def __enter__(self) -> LocalStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
