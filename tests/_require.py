"""A test that needs a tool skips where it is missing — except under ``CI=true``, where
``.ci/run`` installs every tool the suite needs, so a missing one is a failure: a green CI
that silently skipped the fault suite proves nothing."""

from __future__ import annotations

import os

import pytest


def require(ok: bool, what: str) -> None:
    """Fail (``CI=true``) or skip (elsewhere) the calling test unless ``ok``; ``what`` says
    what is missing and how to get it."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (CI=true: .ci/run must provide it; the suite never skips in CI)")
    pytest.skip(what)
