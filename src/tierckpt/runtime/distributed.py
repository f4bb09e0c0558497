"""Process-group start-up for torchrun jobs: minute-scale timeouts and a fresh store namespace
for every incarnation of the job.

``init_distributed()`` is what a training script calls first. It reads torchrun's environment,
picks the backend and device, initialises the default process group with a timeout of minutes
(not torch's 30-minute gloo default), and records ``process_start`` and ``pg_ready`` events so
that the restart cost R can be decomposed.

Its parts: torchrun's environment, the backend and the device are
:mod:`tierckpt.runtime.distenv`; the start-up handshake that gives every incarnation a fresh
store namespace (and why restarts hung without it) is :mod:`tierckpt.runtime.incarnation`.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tierckpt import _proc
from tierckpt.errors import ConfigError
from tierckpt.runtime import healenv
from tierckpt.runtime.distenv import choose_backend, choose_device, positive_seconds, read_env
from tierckpt.runtime.events import PG_READY, PROCESS_START, EventLog
from tierckpt.runtime.incarnation import agree_incarnation, base_store, pg_prefix
from tierckpt.runtime.orphan import watch_launcher
from tierckpt.runtime.scheduler import Scheduler, detect

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistInfo",
    "Joined",
    "init_distributed",
    "process_started_at",
    "timeout_env_recipe",
]

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""Collective and start-up timeout: a dead or hung peer surfaces in minutes, not 30."""



@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job, as seen by ``init_distributed``.

    ``incarnation`` is the id all ranks of this start of the job agreed on (fresh on every
    restart); ``pg_seconds`` is how long the process group took to become ready;
    ``process_started_at`` is this process's start in wall-clock seconds (None off Linux);
    ``scheduler`` is the Slurm job or Kubernetes pod this process runs in, with the
    scheduler's restart count (None: neither; :mod:`tierckpt.runtime.scheduler`);
    ``generation`` is the heal generation it joined (0 unless it replaced a dead rank under
    ``tierckpt run --heal``).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    restart_count: int
    backend: str
    device: torch.device
    incarnation: str
    pg_seconds: float
    process_started_at: float | None
    scheduler: Scheduler | None = None
    generation: int = 0

    @property
    def is_coordinator(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


@dataclass
class Joined:
    """What ``init_distributed`` joined, kept for re-forming the group after a heal
    (:mod:`tierckpt.heal.regroup`): the job's store, the backend and timeout, this
    process's rank, and the heal launcher's environment (None: not started by it), whose
    ``gen`` follows each re-formation."""

    store: Any
    backend: str
    timeout: timedelta
    rank: int
    world_size: int
    device: torch.device
    heal: healenv.HealEnv | None


_JOINED: list[Joined] = []


def joined() -> Joined | None:
    """The group ``init_distributed`` joined in this process (None: it was not called)."""
    return _JOINED[-1] if _JOINED else None


def generation() -> int:
    """The heal generation this process's default group belongs to (0: never healed, or
    not started by the heal launcher)."""
    j = joined()
    return j.heal.gen if j is not None and j.heal is not None else 0


def timeout_env_recipe(timeout: timedelta = DEFAULT_TIMEOUT) -> dict[str, str]:
    """Environment for ProcessGroupNCCL so a failed or hung peer ends the process in minutes.

    Must be in the environment before the NCCL process group is created (``init_distributed``
    applies it with ``setdefault`` when the backend includes NCCL, so explicit settings win).

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: on a collective timeout or NCCL error, abort the
      communicator and tear the process down (what torchrun also exports), so the agent sees a
      failed worker and restarts the group.
    - ``TORCH_NCCL_ENABLE_MONITORING=1`` + ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: kill the process
      when the NCCL watchdog thread itself is stuck (e.g. in a hung CUDA call) that long.
    - ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` + ``TORCH_NCCL_TRACE_BUFFER_SIZE``: leave a flight-recorder
      dump that names the collective each rank was in.
    """
    seconds = positive_seconds(timeout, "timeout")
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(60, int(seconds))),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    }


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    event_log: str | os.PathLike[str] | EventLog | None = None,
) -> DistInfo:
    """Initialise the default process group for this process and return where it sits.

    Call once per process, before any collective. Under torchrun it reads ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT``; without any of them it starts a
    one-process group on loopback (handy for examples and tests).

    ``backend``: None picks ``"cpu:gloo,cuda:nccl"`` when CUDA is available (CPU collectives,
    e.g. DCP's coordination, keep working) and ``"gloo"`` otherwise. With CUDA the device is
    ``cuda:<LOCAL_RANK>``, made current, and passed as ``device_id`` so NCCL connects eagerly.

    ``timeout`` bounds the store handshake, gloo's connection set-up and every collective.

    ``event_log``: a path (one JSONL file for all ranks is fine) or an open ``EventLog``;
    receives ``process_start`` (restart_count, process_started_at, and ``scheduler`` under
    Slurm or Kubernetes: its name, job id and restart count — the requeue this run is) before
    anything can block and ``pg_ready`` (seconds, incarnation, backend, world_size) once the
    group is up.

    Raises ConfigError for bad arguments or environment, CheckpointError when the ranks of
    this incarnation do not all show up within ``timeout``; torch's own errors from the store
    or backend propagate unchanged.

    At exit (``atexit``, while the interpreter is still whole) it collects garbage: FSDP2
    modules sit in reference cycles that hold the process group through their device mesh,
    and a group freed during interpreter finalisation sometimes aborts a finished gloo
    process (SIGABRT; torchrun then restarts a job that had completed). Under torchrun it
    also watches the launcher: a worker whose agent died stops itself
    (:mod:`tierckpt.runtime.orphan`; ``TIERCKPT_ORPHANS=keep`` turns that off).
    """
    positive_seconds(timeout, "timeout")
    if dist.is_initialized():
        raise ConfigError("init_distributed: the default process group is already "
                          "initialised; call init_distributed once per process")
    env = read_env()
    scheduler = detect(os.environ)
    log, owns_log = _open_log(event_log, env["rank"])
    try:
        if log is not None:
            extra: dict[str, Any] = {"scheduler": scheduler.to_json()} if scheduler else {}
            log.emit(PROCESS_START, restart_count=env["restart_count"],
                     process_started_at=process_started_at(), **extra)
        chosen = choose_backend(backend)
        device = choose_device(chosen, env["local_rank"])
        up = _join(env, chosen, device, timeout)
        watch_launcher(log.path if log is not None else None)
        if log is not None:
            extra = {"generation": up.heal.gen} if up.heal is not None else {}
            log.emit(PG_READY, seconds=up.seconds, incarnation=up.incarnation, backend=chosen,
                     world_size=env["world_size"], **extra)
    finally:
        if owns_log and log is not None:
            log.close()
    return _info(env, chosen, device, up, scheduler)


@dataclass(frozen=True)
class _Up:
    """What :func:`_join` brought up: the incarnation's id, the seconds it took, and the
    heal launcher's environment (None: not started by it)."""

    incarnation: str
    seconds: float
    heal: healenv.HealEnv | None


def _join(env: dict[str, Any], backend: str, device: torch.device,
          timeout: timedelta) -> _Up:
    """Bring the default process group up under a fresh store prefix: the heal launcher's
    generation prefix when it started this process (it drew this start's id, and a
    generation's prefix keeps a dead group unread), else the id the ranks agree on
    (:func:`~tierckpt.runtime.incarnation.agree_incarnation`). Registers the group for
    :func:`joined` and the garbage collection at exit."""
    rank, world_size = env["rank"], env["world_size"]
    if "nccl" in backend:
        for key, value in timeout_env_recipe(timeout).items():
            os.environ.setdefault(key, value)
    t0 = time.monotonic()
    store = base_store(env, timeout)
    heal = healenv.read()
    if heal is not None:
        incarnation, prefix = heal.id, heal.pg_prefix()
    else:
        incarnation = agree_incarnation(store, rank, world_size, timeout)
        prefix = pg_prefix(incarnation)
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(prefix, store), rank=rank,
        world_size=world_size, timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    seconds = time.monotonic() - t0
    _JOINED.append(Joined(store, backend, timeout, rank, world_size, device, heal))
    _collect_at_exit()
    return _Up(incarnation, seconds, heal)


def _info(env: dict[str, Any], backend: str, device: torch.device, up: _Up,
          scheduler: Scheduler | None) -> DistInfo:
    return DistInfo(
        rank=env["rank"], world_size=env["world_size"], local_rank=env["local_rank"],
        local_world_size=env["local_world_size"], node_rank=env["node_rank"],
        restart_count=env["restart_count"], backend=backend, device=device,
        incarnation=up.incarnation, pg_seconds=up.seconds,
        process_started_at=process_started_at(), scheduler=scheduler,
        generation=0 if up.heal is None else up.heal.gen,
    )


_EXIT_HOOK: list[bool] = []


def _collect_at_exit() -> None:
    """Register (once per process) a garbage collection at interpreter exit: it frees the
    reference cycles that hold the process group before finalisation (see
    :func:`init_distributed`)."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(gc.collect)


def process_started_at() -> float | None:
    """Wall-clock time (seconds since the epoch) at which this process started, or None.

    Read from ``/proc`` (10 ms resolution), so R includes interpreter and import time.
    """
    ticks = _proc.start_ticks("self")
    try:
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if ticks is None:
        return None
    age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - max(age, 0.0)


def _open_log(event_log: str | os.PathLike[str] | EventLog | None,
              rank: int) -> tuple[EventLog | None, bool]:
    if event_log is None or isinstance(event_log, EventLog):
        return event_log, False
    if not isinstance(event_log, (str, os.PathLike)):
        raise ConfigError(f"event_log must be a path or an EventLog, got {event_log!r}")
    return EventLog(event_log, rank=rank), True


