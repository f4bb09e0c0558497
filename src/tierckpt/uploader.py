"""``python -m tierckpt.uploader TIER1 TIER2 [--watch]``: the tier-2 uploader process.

A stable entry point only; the uploader lives in :mod:`tierckpt.tier2.uploader`. This module
imports no torch, so the process starts fast.
"""

from __future__ import annotations

import sys

from tierckpt.tier2.uploader import main

if __name__ == "__main__":
    sys.exit(main())
