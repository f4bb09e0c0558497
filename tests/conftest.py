"""Shared pytest fixtures, and the reference runs of tests/_references.py (once a session)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from typing import Any

    from tests._references import FsdpReference

pytest_plugins = ["s3server", "azureserver", "gcsserver"]


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory on tmpfs (/dev/shm) for tier-0 roots, removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    d = Path(tempfile.mkdtemp(prefix="tierckpt-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> FsdpReference:
    """tests/workloads/fsdp_train.py on 2 ranks, 12 steps, uninterrupted, its state dumped at
    the last save (:func:`tests._references.run_fsdp_reference`). test_manager_dist.py
    compares its kills and reshards with it and loads its checkpoint with plain DCP;
    tier0/test_nodes.py compares its two-node tier-0 runs with its losses (the per-step loss
    is the global mean: it depends neither on how the 2 ranks are launched nor on where the
    checkpoints go)."""
    from tests._references import run_fsdp_reference  # torch: only once a test needs it

    return run_fsdp_reference(tmp_path_factory.mktemp("fsdp-reference"))


@pytest.fixture(scope="session")
def example_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """examples/train.py on 2 ranks with ``tests._references.EXAMPLE_SMALL`` (24 steps),
    uninterrupted: step → rank 0's row (:func:`tests._references.run_example_reference`).
    preempt/test_preempt_dist.py compares its preempted and restarted runs with its
    ``loss_hex``; test_example_train.py its SIGKILLed and resumed run with its ``loss_hex``
    and ``lr``. Read it, never change it."""
    from tests._references import run_example_reference

    return run_example_reference(tmp_path_factory.mktemp("example-reference"))
