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

pytest_plugins = ["s3server", "azureserver", "gcsserver", "etcdserver"]

BESIDE = (
    # `make test` runs these in a second pytest beside the rest (marker `beside`): they spend
    # most of their wall time waiting — on the object-store servers and the fault proxy, on
    # timeouts and watchdogs — so the CPU-bound lane keeps its cores. Measured per file (CPU
    # seconds of the test and its children ÷ wall seconds): the tier-2 tests 0.05-0.5, the
    # notices, watchdogs and requeues 0.01-0.65. test_manager_dist.py and tier0/test_nodes.py
    # (CPU-bound) come along because they share the session's FSDP reference run, which each
    # lane would otherwise repeat.
    "tests/tier2/",
    "tests/test_tier2_gcs.py", "tests/test_tier2_azure.py", "tests/cli/test_object_stores.py",
    "tests/test_manager.py", "tests/test_manager_interval.py", "tests/test_manager_tier2.py",
    "tests/restore/test_choose.py", "tests/restore/test_metadata.py",
    "tests/preempt/test_watch.py", "tests/preempt/test_requeue.py",
    "tests/preempt/test_session.py", "tests/journeys/test_preemption.py",
    "tests/runtime/test_orphan.py", "tests/runtime/test_watchdog.py",
    "tests/runtime/test_scheduler.py", "tests/runtime/test_steps.py",
    "tests/heal/test_launcher.py", "tests/cli/test_doctor.py", "tests/test_bench_transfer.py",
    "tests/test_manager_dist.py", "tests/tier0/test_nodes.py",
    # CPU ÷ wall 0.8-1.3, moved to balance the two lanes (the CPU-bound one took ~23 min,
    # this one ~14): the journeys, the loader and restore log, the example and its notice
    # runs (they share the example's reference run), two drop-ins, two-node runs, the kill
    # sweeps, and the share and tier-0 bench sections.
    "tests/journeys/", "tests/restore/test_loader.py", "tests/restore/test_restore_log.py",
    "tests/test_example_train.py", "tests/preempt/test_preempt_dist.py",
    "tests/integrations/test_accelerate.py", "tests/integrations/test_torchtitan.py",
    "tests/test_multinode.py", "tests/faults/test_fault_kill_sweep.py",
    "tests/faults/test_fault_restore_kill.py", "tests/test_bench_share.py",
    "tests/test_bench_tier0.py",
    # the incremental saves' bench section waits on its SeaweedFS uploads, save by save
    "tests/test_bench_incremental.py",
)


TIMERS = (
    # `make test` runs these in a third pytest (marker `timers`): the scheduler tests wait on
    # slurmctld's timers (a 1-minute time limit, requeues, KillWait) at ~0.1 CPU ÷ wall, so
    # their ~5 minutes of waiting need not lengthen either other lane.
    "tests/slurm/",
    # the node heals (~4.5 min) wait mostly on node timeouts and pre-warmed spare nodes
    "tests/heal/test_nodes.py", "tests/launch/test_heal_kit.py",
    "tests/test_drill_heal_nodes.py",
    # the chaos drill's object faults wait on uploads (the uploader polls every 2 s), ~1.5 min
    "tests/test_drill_chaos_dedup.py",
    # to balance the lanes (CI on 2 cores: main 31.8 min, beside 31.2, this one 20.7): the
    # chaos drills (~3.7 min of main) and the preemption and heal drills (~3.7 of beside)
    "tests/test_drill_chaos.py", "tests/test_drill_chaos_heal.py",
    "tests/test_drill_preempt.py", "tests/test_drill_heal.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`BESIDE` ``beside`` and those of :data:`TIMERS` ``timers``."""
    for item in items:
        if item.nodeid.startswith(BESIDE):
            item.add_marker(pytest.mark.beside)
        if item.nodeid.startswith(TIMERS):
            item.add_marker(pytest.mark.timers)


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
