"""Healing a dead rank without restarting the job: the launcher side (``tierckpt run
--heal``) — supervision, generations, pre-warmed spares. The worker side is
:meth:`tierckpt.CheckpointManager.heal` over :mod:`tierckpt.runtime.regroup`; docs/heal.md
is the design."""
