"""A survivor's side of a heal, start to end: the procedure behind
:meth:`tierckpt.CheckpointManager.heal` (docs/heal.md, "What a heal does").

On a torch outside :data:`tierckpt._torch.TESTED` it declines (HealError: the launcher
restarts the whole job). Else, in order: tell the launcher this rank is leaving (else it is
taken for stuck), let go of everything bound to the failed generation
(:func:`tierckpt._torch.fsdp2.detach`, then the manager's ``leave``), join the launcher's
next generation (:func:`tierckpt.heal.regroup.regroup`), point FSDP2 at it, run the user's
``rebuild`` (a DDP wrapper), reopen the manager on the new group, and load the newest
complete checkpoint in place (``restore``) — with the replacement, whose own ``restore()``
is that call's other side. The manager keeps its lifecycle; this module only sequences it,
times it and reports it (``heal_begin``, ``heal_done`` or ``heal_failed``)."""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from tierckpt._torch import fsdp2, untested
from tierckpt.errors import ConfigError, HealError
from tierckpt.format import layout
from tierckpt.heal import regroup
from tierckpt.restore.loader import RestoreInfo
from tierckpt.runtime import events
from tierckpt.state import TrainState, require_state


@dataclasses.dataclass(frozen=True)
class Manager:
    """What a heal needs of the manager, as callables: ``leave`` lets go of the failed
    generation (waits briefly for its save, releases the lock and the group), ``reopen``
    opens the manager again on the re-formed group, ``restore`` is its ``restore``, and
    ``log`` returns its current event log (a new one after ``reopen``); ``tier1`` is where
    a failed heal's event goes."""

    leave: Callable[[], None]
    reopen: Callable[[], None]
    restore: Callable[[TrainState], RestoreInfo | None]
    log: Callable[[], events.EventLog]
    tier1: Path


def heal(manager: Manager, state: TrainState, error: BaseException,
         rebuild: Callable[[], None] | None) -> RestoreInfo:
    """Heal this survivor (see the module docstring and
    :meth:`tierckpt.CheckpointManager.heal` for the contract). ``error`` is raised again,
    unchanged, when this process cannot heal; :class:`HealError` when the heal fails."""
    j = regroup.healing()
    if j is None or j.heal is None or not isinstance(error, RuntimeError) \
            or isinstance(error, ConfigError):
        raise error
    require_state(state)
    declined = untested("healing in place")
    if declined is not None:  # the surgery below is FSDP2/DDP internals: never run untested
        raise HealError(f"rank {j.rank}: {declined}; the launcher restarts the whole job "
                        "instead") from error
    gen, phase, times = j.heal.gen, "leave", [time.monotonic()]
    regroup.mark_left()  # else the launcher takes this rank for stuck and replaces it
    manager.log().emit(events.HEAL_BEGIN, generation=gen,
                       error=f"{type(error).__name__}: {error}"[:500])
    traceback.clear_frames(error.__traceback__)  # the failed step's frames hold groups
    try:
        fsdp2.detach(state.model)  # peers waiting on this rank's sockets fail now
        manager.leave()
        times.append(time.monotonic())
        phase = "regroup"
        joined = regroup.regroup()
        fsdp2.rebind_fsdp(state.model)
        times.append(time.monotonic())
        phase = "open"
        if rebuild is not None:
            rebuild()
        manager.reopen()
        times.append(time.monotonic())
        phase = "restore"
        info = manager.restore(state)
        if info is None:  # the survivors' state is past the start: nothing to go back to
            raise HealError("no complete checkpoint to roll back to")
    except BaseException as e:
        log = events.EventLog(manager.tier1 / layout.EVENTS, rank=j.rank)
        log.emit(events.HEAL_FAILED, generation=gen, phase=phase,
                 error=f"{type(e).__name__}: {e}"[:500])
        log.close()
        raise HealError(f"rank {j.rank}: the heal of generation {gen} failed while "
                        f"{phase}: {e}") from e
    done = time.monotonic()
    manager.log().emit(events.HEAL_DONE, step=info.step, generation=joined.gen,
                       dead=list(regroup.replaced(joined.gen)), source=info.source,
                       seconds=done - times[0], leave_s=times[1] - times[0],
                       wait_s=joined.wait_s, form_s=joined.form_s,
                       open_s=times[3] - times[2], restore_s=done - times[3])
    return info
