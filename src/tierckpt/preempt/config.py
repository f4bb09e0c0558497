"""How a job hears of a coming termination and what it does then: :class:`Preemption`, one
frozen config that :class:`tierckpt.ManagerConfig` composes. Torch-free."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Protocol, runtime_checkable

from tierckpt.errors import ConfigError
from tierckpt.policy.units import check_seconds
from tierckpt.preempt.notice import Notice

EXIT_PREEMPTED = 75
"""The process's exit status after a notice was acted on and the emergency save is
committed: "preempted, checkpoint saved — run me again" (sysexits' ``EX_TEMPFAIL``).
Distinct from 0 (finished), 1 (a failure) and 128+N (killed by signal N)."""

DEFAULT_GRACE_S = 30.0
"""The grace when neither :attr:`Preemption.grace_s` nor the job's launcher or scheduler
says (Kubernetes' default ``terminationGracePeriodSeconds``)."""

TRIGGER_FILE_ENV = "TIERCKPT_STOP_FILE"
"""Environment variable naming a trigger file when :attr:`Preemption.trigger_file` is unset."""


@runtime_checkable
class Poller(Protocol):
    """A notice source asked from the watcher thread every :attr:`every_s` seconds.

    ``poll()`` returns a :class:`Notice` once termination is announced, else None. It must
    return within about a second (bound its own I/O), and it may raise: the watcher logs the
    error once per kind and keeps polling."""

    name: str
    every_s: float

    def poll(self) -> Notice | None: ...


def _signal_number(value: object) -> int:
    if isinstance(value, signal.Signals):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return int(signal.Signals(value))
        except ValueError:
            pass
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        if hasattr(signal.Signals, name):
            return int(signal.Signals[name])
    raise ConfigError(f"Preemption.signals: {value!r} is not a signal; use names such as "
                      "'SIGTERM' or 'SIGUSR1'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preemption:
    """Termination notices and the emergency save (see docs/preemption.md).

    Nothing happens until the training loop calls
    :meth:`~tierckpt.CheckpointManager.should_stop`: that first call is the opt-in. Before
    it (and in a script that never calls it) a notice signal does what it did without
    tierckpt — its previous handler, or the default action, which ends the process.
    """

    signals: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGUSR1))
    """Signals that announce a termination (names or numbers); () for none."""
    grace_s: float | None = None
    """Seconds from a notice to the expected kill when its source does not say. None: what
    the job's launcher or scheduler says (``$TIERCKPT_GRACE_S``; under Slurm the
    ``--signal`` lead for its signal and the partition's ``GraceTime`` for SIGTERM:
    :mod:`tierckpt.runtime.scheduler`), else :data:`DEFAULT_GRACE_S`. A number wins over
    all of them."""
    trigger_file: Path | None = None
    """A file whose appearance is a notice (a sidecar or preStop hook writes it); None: the
    ``TIERCKPT_STOP_FILE`` environment variable, if set. A number in it is the seconds of
    grace left."""
    pollers: tuple[Poller, ...] = ()
    """Extra notice sources, e.g. :class:`tierckpt.preempt.pollers.AwsSpot` or
    :class:`~tierckpt.preempt.pollers.GcpPreemption`."""
    margin_s: float = 2.0
    """Seconds kept free before the deadline: a copy is only started to a tier it can reach
    by ``deadline - margin_s``."""
    exit_code: int | None = EXIT_PREEMPTED
    """The status the process exits with after ``close()`` once the loop stopped on a
    notice (close raises SystemExit); None: close returns and the script decides."""
    watch_s: float = 0.05
    """How often the watcher thread looks for a notice (locally and in the job's store)."""
    slurm_requeue: bool = True
    """Under Slurm, after an announced notice (a preemption, or the ``--signal`` lead) whose
    emergency save committed, rank 0 asks Slurm to run the job again (``scontrol requeue``)
    if the job is requeueable (``#SBATCH --requeue``); a ``scancel`` never is. False: never
    (the batch script decides). See :mod:`tierckpt.preempt.requeue`."""

    def __post_init__(self) -> None:
        if isinstance(self.signals, str | int):
            raise ConfigError("Preemption.signals must be a tuple, e.g. ('SIGTERM', 'SIGUSR1')")
        sigs = tuple(_signal_number(s) for s in self.signals)
        for bad in (signal.SIGKILL, signal.SIGSTOP):
            if int(bad) in sigs:
                raise ConfigError(f"Preemption.signals: {bad.name} cannot be caught")
        object.__setattr__(self, "signals", sigs)
        if self.grace_s is not None:
            check_seconds("Preemption.grace_s", self.grace_s)
        check_seconds("Preemption.margin_s", self.margin_s, allow_zero=True)
        check_seconds("Preemption.watch_s", self.watch_s)
        if self.trigger_file is not None:
            object.__setattr__(self, "trigger_file", Path(self.trigger_file))
        pollers = tuple(self.pollers)
        for p in pollers:
            if not isinstance(p, Poller):
                raise ConfigError(f"Preemption.pollers: {p!r} has no name, every_s and poll()")
        object.__setattr__(self, "pollers", pollers)
        if not isinstance(self.slurm_requeue, bool):
            raise ConfigError(f"Preemption.slurm_requeue must be True or False, got "
                              f"{self.slurm_requeue!r}")
        code = self.exit_code
        if code is not None and (isinstance(code, bool) or not isinstance(code, int)
                                 or not 1 <= code <= 125):
            raise ConfigError(f"Preemption.exit_code must be None or an int in 1..125, got "
                              f"{code!r}")

    def trigger_path(self) -> Path | None:
        """The trigger file in effect (the field, else ``$TIERCKPT_STOP_FILE``)."""
        if self.trigger_file is not None:
            return self.trigger_file
        env = os.environ.get(TRIGGER_FILE_ENV)
        return Path(env) if env else None
