"""Shared pytest fixtures."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["s3server"]


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory on tmpfs (/dev/shm) for tier-0 roots, removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    d = Path(tempfile.mkdtemp(prefix="tierckpt-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)

