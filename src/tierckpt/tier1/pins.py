"""Pin files of a tier-1 root: which holders keep which step from tier-1 retention.

A pin is an empty file ``<root>/pins/step-XXXXXXXX.<holder>`` (names from
:mod:`tierckpt.format.layout`). :func:`pin` returns only once the file is durable, so
retention in any process sees it; :func:`unpin` of a pin that does not exist is a no-op.
The meanings of the holders are their owners' (the uploader's in :mod:`tierckpt.tier1.uploads`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tierckpt.format import layout
from tierckpt.tier1 import fs


def read_pins(root: Path) -> dict[int, list[str]]:
    """Pin holders by step, from ``pins/step-XXXXXXXX.<holder>`` files (holders sorted by
    file name); {} when there is no ``pins/``."""
    out: dict[int, list[str]] = {}
    d = root / layout.PINS
    if d.is_dir():
        for name in sorted(os.listdir(d)):
            step = layout.parse_pin_filename(name)
            if step is not None and "." in name:
                out.setdefault(step, []).append(name.split(".", 1)[1])
    return out


def pin(root: Path, step: int, holder: str) -> None:
    """Pin ``step`` for ``holder`` (durably: retention sees it before this returns)."""
    path = root / layout.PINS / layout.pin_filename(step, holder)
    path.parent.mkdir(mode=fs.DEFAULT_DIR_MODE, exist_ok=True)
    fs.write_durably(path, b"")


def unpin(root: Path, step: int, holder: str) -> None:
    """Remove ``holder``'s pin of ``step``, if there is one."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / layout.PINS / layout.pin_filename(step, holder))
