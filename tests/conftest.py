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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``make test`` (pytest-xdist, ``-n 2 --dist loadgroup``) each test file is one
    group, so its module fixtures (a drill run, a reference job) are built once, on one
    worker; every scheduler test is in one group, so one worker starts the one Slurm cluster.
    Without xdist the groups do nothing."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            parts = item.path.relative_to(config.rootpath).parts
            group = "slurm" if parts[:2] == ("tests", "slurm") else "/".join(parts)
            item.add_marker(pytest.mark.xdist_group(group))
