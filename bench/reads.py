"""Which files a process opens for reading below a directory, and how big they are: the
bytes of metadata a restoring rank reads, measured rather than derived (``bench.scale``).

Built on Python's ``open`` audit event (PEP 578), which ``open()`` and ``os.open`` both
raise on every thread, so nothing in tierckpt or DCP is wrapped or patched.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any


class Reads:
    """Every regular file opened for reading below ``root`` while open, by this process
    (any thread), through ``open()`` or ``os.open`` (Python's ``open`` audit event).

    ``files``: ``[(name, size)]`` in order, a name relative to its checkpoint directory;
    the size is the file's at open time. Metadata files are read whole, so their sizes are
    the bytes read; shard files (``*.distcp``) are read in ranges and only counted. One at
    a time per process (the audit hook, once installed, cannot be removed; it idles).
    """

    _current: Reads | None = None
    _installed = False
    _lock = threading.Lock()

    def __init__(self, root: Path) -> None:
        self.roots = tuple({os.path.abspath(root) + os.sep, os.path.realpath(root) + os.sep})
        self.files: list[tuple[str, int]] = []

    def __enter__(self) -> Reads:
        with Reads._lock:
            if not Reads._installed:
                sys.addaudithook(Reads._hook)
                Reads._installed = True
            Reads._current = self
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        Reads._current = None

    @staticmethod
    def _hook(event: str, args: tuple[Any, ...]) -> None:
        me = Reads._current
        if me is None or event != "open" or not isinstance(args[0], str | os.PathLike):
            return
        path, mode, flags = os.fspath(args[0]), args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & os.O_ACCMODE != os.O_RDONLY)
        root = next((r for r in me.roots if isinstance(path, str) and path.startswith(r)),
                    None)
        if writing or root is None or not os.path.isfile(path):
            return
        try:
            size = os.stat(path).st_size
        except OSError:
            return
        me.files.append((path[len(root):], size))

    def to_json(self) -> dict[str, Any]:
        """``metadata_bytes`` (every non-shard file, summed over opens), ``by_file``
        ``{name: bytes}``, ``opens`` of those, and ``shard_files`` opened."""
        meta = [(n, s) for n, s in self.files if not n.endswith(".distcp")]
        by_file: dict[str, int] = {}
        for n, s in meta:
            by_file[os.path.basename(n)] = by_file.get(os.path.basename(n), 0) + s
        return {"metadata_bytes": sum(s for _, s in meta), "by_file": by_file,
                "opens": len(meta), "shard_files": len(self.files) - len(meta)}
