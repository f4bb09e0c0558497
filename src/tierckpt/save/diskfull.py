"""A failed save that ran out of space, found and told as one :class:`DiskFullError`.

:func:`disk_full` is what the saver asks of every failure: None when no ENOSPC is in it
(the failure is reported as it is), else the one-line error that names the tier, its free
space and what the save needed. ENOSPC is found in the exception's causes and in the
per-rank failures of DCP's ``CheckpointException``, where a remote rank's error survives
as text only.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tierckpt.errors import DiskFullError, SaveError
from tierckpt.policy.units import format_bytes

_ENOSPC_TEXT = ("[Errno 28]", "No space left on device")


def disk_full(e: BaseException, *, tier: str, root: Path, step: int, needed: int,
              rank: int) -> DiskFullError | None:
    """The error of a save of ``step`` that needed about ``needed`` bytes on ``rank`` and
    failed for lack of space on ``tier`` at ``root``; None when ``e`` is not ENOSPC."""
    if not is_enospc(e):
        return None
    try:
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return DiskFullError(
        f"{tier} is full: {root} has {format_bytes(free)} free, and the save of step "
        f"{step} needs about {format_bytes(needed)} on rank {rank}; "
        "nothing of that save was kept, and the previous complete checkpoint stays the "
        "restore point. Free space there or lower keep_last (ENOSPC: No space left on "
        "device)",
        tier=tier, path=str(root), free=free, needed=needed)


def is_enospc(e: BaseException, depth: int = 0) -> bool:
    """ENOSPC anywhere in ``e``: its causes, or the per-rank failures of DCP's
    CheckpointException (whose text is all a remote rank's error leaves here)."""
    if depth > 8:
        return False
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    if isinstance(e, SaveError) and _says_enospc(e):
        return True  # a remote rank's failure, as its text
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        if any(isinstance(f, BaseException) and is_enospc(f, depth + 1)
               for f in failures.values()):
            return True
        if _says_enospc(e):
            return True
    return any(c is not None and is_enospc(c, depth + 1) for c in (e.__cause__, e.__context__))


def _says_enospc(e: BaseException) -> bool:
    return any(t in str(e) for t in _ENOSPC_TEXT)
