"""Healing a dead rank without restarting the job, in one wing: the launcher side
(``tierckpt run --heal``: supervision, generations, pre-warmed spares; torch-free until a
spare starts) and the worker side (:mod:`~tierckpt.heal.survivor`, the procedure behind
:meth:`tierckpt.CheckpointManager.heal`, over :mod:`~tierckpt.heal.regroup`). The contract
between the two, read by every process at start, is :mod:`tierckpt.runtime.healenv`;
docs/heal.md is the user's page. The job's store for a heal across nodes, in etcd so that it
outlives any node, is :mod:`~tierckpt.runtime.etcdstore` (issue 43)."""
