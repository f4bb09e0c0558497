"""The tier-2 promoter: copies committed tier-1 checkpoints to object storage, verified.

It runs as its own low-priority process (``nice`` 19, idle I/O class), one per tier-1 root
(a per-root lock enforces it): :class:`UploaderProcess` starts one from the library, and
``python -m tierckpt.uploader TIER1 TIER2`` runs one alone. :class:`Uploader` is the same
logic in-process. The parts, one job each:

- :mod:`~tierckpt.tier2.uploader.config` — what to upload, where, and the result values;
- :mod:`~tierckpt.tier2.uploader.transfer` — moving the bytes of one pinned step, verified;
- :func:`tierckpt.policy.retention.next_upload` — the pure policy of what is due next;
- :mod:`~tierckpt.tier2.uploader.watch` — the loop (polling, back-off), used by the process
  and by ``tierckpt upload [--watch]``;
- :mod:`~tierckpt.tier2.uploader.uploader` — :class:`Uploader`, which composes them;
- :mod:`~tierckpt.tier2.uploader.process` and :mod:`~tierckpt.tier2.uploader.priority` —
  the child process, its priority and its exit when the rank that started it dies.

Upload records and pins live on tier 1 and are read and written through
:class:`tierckpt.tier1.catalog.Tier1Catalog`; tier-2 state through
:class:`tierckpt.tier2.catalog.Tier2Catalog`.
"""

from tierckpt.tier2.uploader.config import DONE, UploaderConfig, UploadResult
from tierckpt.tier2.uploader.process import UploaderProcess, main
from tierckpt.tier2.uploader.uploader import Uploader

__all__ = ["DONE", "UploadResult", "Uploader", "UploaderConfig", "UploaderProcess", "main"]
