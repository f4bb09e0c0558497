"""Fixtures of the checkpoint commands' tests (ls, verify, upload, fetch, gc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._checkpoints import save_steps


@pytest.fixture(scope="session")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tier-1 root with committed steps 1, 2, 3 written by a real CheckpointManager
    (copy it per test with ``_checkpoints.clone``; never modify it)."""
    root = tmp_path_factory.mktemp("tier1-template") / "t1"
    save_steps(root, [1, 2, 3])
    return root
