"""Tier 2 for the bench sections' module-scoped fixtures (``tests/test_bench_share.py``,
``test_bench_tier0.py``, ``test_bench_transfer.py``): each measures its section once per
module on the session's SeaweedFS, where the per-test ``s3_env`` and ``monkeypatch`` cannot
be used."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from s3server import S3Server


@contextlib.contextmanager
def server_env(server: S3Server, prefix: str) -> Iterator[str]:
    """``s3://<bucket>/<prefix>`` on ``server``, with the server's AWS_* variables set in
    ``os.environ`` meanwhile (restored on exit). The section makes its own fresh prefix
    under it; the test checks that nothing is left under ``prefix``."""
    with pytest.MonkeyPatch.context() as env:
        for k, v in server.env().items():
            env.setenv(k, v)
        yield f"s3://{server.bucket}/{prefix}"
