"""Process-group start-up for torchrun jobs: minute-scale timeouts and a fresh store namespace
for every incarnation of the job.

``init_distributed()`` is what a training script calls first. It reads torchrun's environment,
picks the backend and device, initialises the default process group with a timeout of minutes
(not torch's 30-minute gloo default), and records ``process_start`` and ``pg_ready`` events so
that the restart cost R can be decomposed.

Why restarts used to hang (torch 2.13, found on this machine)
-------------------------------------------------------------
Symptom: after torchrun restarts a gloo job whose rank was SIGKILLed, the new ranks often fail
or hang in ``init_process_group``; gloo's ``connectFullMesh`` keeps dialling addresses of the
*previous* attempt's processes.

Cause, from the sources in ``torch/distributed``:

1. ``elastic/rendezvous/dynamic_rendezvous.py`` (c10d rendezvous, also used by
   ``--standalone``) shares one TCPStore server, hosted by the agent, with the workers
   (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset; torch >= 2.5). ``next_rendezvous`` creates
   that server only on the first round (``self._shared_tcp_store_server`` is cached) and hands
   every later round the same ``MASTER_ADDR``/``MASTER_PORT``. The store, and every key in it,
   outlives each worker incarnation.
2. ``rendezvous.py::_create_c10d_store`` gives workers a bare client of that store when
   ``TORCHELASTIC_USE_AGENT_STORE=True``. Its comment says "We create a new TCPStore for every
   retry so no need to add prefix for each attempt" - no longer true after (1). torch <= 2.4
   wrapped it in ``PrefixStore(f"/worker/attempt_{TORCHELASTIC_RESTART_COUNT}")``; that
   prefix is gone.
3. ``distributed_c10d.init_process_group`` therefore uses the same key names in every
   incarnation. Gloo publishes each rank's listening address under
   ``default_pg/0//cpu//0/<rank>`` and a peer reads it with ``wait``+``get``. Before a new rank
   overwrites its key, the old one is still there: a peer reads the dead process's address and
   dials it (connection refused → retries → "Gloo connectFullMesh failed", or a hang until the
   timeout). Observed directly: at the start of attempt 1 the store already held
   ``default_pg/0//cpu//0/0`` and ``.../1`` from attempt 0. Whether a restart survives is a race
   between one rank's ``set`` and its peer's ``get``. NCCL has the same race on its unique-id
   key (pytorch/pytorch#135712).

Why a restart-count prefix is not enough: ``TORCHELASTIC_RESTART_COUNT`` is counted by each
agent on its own. With several nodes, the agent whose worker failed increments it while the
others restart through a membership change and do not (``api.py::_invoke_run``: "membership
changes do not count as retries"; pytorch/pytorch#108158); a hot spare joining
(``--nnodes MIN:MAX``) restarts everyone with the count unchanged. Different nodes then pick
different prefixes and hang, or everyone picks the old prefix again and meets stale keys.

The fix here: every incarnation agrees, through the store itself, on a fresh random id and
puts all process-group keys under ``tierckpt/<id>/``. The agreement cannot be fooled by
leftovers: each rank r > 0 posts a fresh nonce; rank 0 answers each nonce it reads with a
grant ``(nonce, id)``; rank r accepts only a grant that echoes *its own* fresh nonce, so only
a rank 0 of the current incarnation can have written it. A stale nonce or grant is simply
superseded (rank 0 re-reads nonces until every rank has acknowledged under the new id, which
no earlier incarnation can have used). It works for any restart reason and any node count,
and costs a few store round trips.

Measured on this machine (2 shared CPU cores, gloo, 2 ranks, ``--standalone``, one rank
SIGKILLs itself after the first all_reduce, init timeout 20 s, 20 jobs of one kill→restart
cycle each; ``tests/scripts/restart_loop.py``): plain ``init_process_group`` restarted
cleanly 5/20 times, failed fast in connectFullMesh 8/20 and hung past 60 s 7/20 (one hang
lasted 106 s despite the 20 s timeout); ``init_distributed`` 20/20 clean, and 20 consecutive
cycles in one job in the tests. A restart-count prefix was also 20/20 on one node but failed
4 of 6 restarts with two agents, where the counts differed. Details: docs/restarts.md.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tierckpt.errors import CheckpointError, ConfigError
from tierckpt.runtime import healenv
from tierckpt.runtime.events import PG_READY, PROCESS_START, EventLog
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

_NAMESPACE = "tierckpt"
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.1


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
    seconds = _positive_seconds(timeout, "timeout")
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
    _positive_seconds(timeout, "timeout")
    if dist.is_initialized():
        raise ConfigError("init_distributed: the default process group is already "
                          "initialised; call init_distributed once per process")
    env = _read_env()
    rank, world_size = env["rank"], env["world_size"]
    scheduler = detect(os.environ)
    log, owns_log = _open_log(event_log, rank)
    try:
        if log is not None:
            extra: dict[str, Any] = {"scheduler": scheduler.to_json()} if scheduler else {}
            log.emit(PROCESS_START, restart_count=env["restart_count"],
                     process_started_at=process_started_at(), **extra)
        chosen = _choose_backend(backend)
        device = _choose_device(chosen, env["local_rank"])
        if "nccl" in chosen:
            for key, value in timeout_env_recipe(timeout).items():
                os.environ.setdefault(key, value)
        t0 = time.monotonic()
        store = _base_store(env, timeout)
        heal = healenv.read()
        if heal is not None:  # the heal launcher drew this start's id; a generation's prefix
            incarnation, prefix = heal.id, heal.pg_prefix()  # keeps a dead group unread
        else:
            incarnation = _agree_incarnation(store, rank, world_size, timeout)
            prefix = f"{_NAMESPACE}/{incarnation}/"
        pg_store = dist.PrefixStore(prefix, store)
        dist.init_process_group(
            backend=chosen, store=pg_store, rank=rank, world_size=world_size,
            timeout=timeout, device_id=device if device.type == "cuda" else None,
        )
        seconds = time.monotonic() - t0
        _JOINED.append(Joined(store, chosen, timeout, rank, world_size, device, heal))
        _collect_at_exit()
        watch_launcher(log.path if log is not None else None)
        if log is not None:
            extra = {"generation": heal.gen} if heal is not None else {}
            log.emit(PG_READY, seconds=seconds, incarnation=incarnation, backend=chosen,
                     world_size=world_size, **extra)
    finally:
        if owns_log and log is not None:
            log.close()
    return DistInfo(
        rank=rank, world_size=world_size, local_rank=env["local_rank"],
        local_world_size=env["local_world_size"], node_rank=env["node_rank"],
        restart_count=env["restart_count"], backend=chosen, device=device,
        incarnation=incarnation, pg_seconds=seconds, process_started_at=process_started_at(),
        scheduler=scheduler, generation=0 if heal is None else heal.gen,
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
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # Field 22 (starttime, clock ticks after boot) counted after the ")" closing comm.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(age, 0.0)


# --- environment -----------------------------------------------------------------------------

def _positive_seconds(value: object, name: str) -> float:
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ConfigError(f"{name} must be a positive datetime.timedelta, got {value!r}")
    return value.total_seconds()


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set; launch with torchrun "
                              "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _read_env() -> dict[str, Any]:
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", None if launched else 0)
    world_size = _env_int("WORLD_SIZE", None if launched else 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE")
    if launched:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise ConfigError(f"environment variable {name} is not set; launch with "
                                  "torchrun or set it to the rank-0 store address")
    return {
        "launched": launched, "rank": rank, "world_size": world_size,
        "local_rank": _env_int("LOCAL_RANK", 0 if not launched else rank),
        "local_world_size": _env_int("LOCAL_WORLD_SIZE", world_size),
        "node_rank": _env_int("GROUP_RANK", 0),
        "restart_count": _env_int("TORCHELASTIC_RESTART_COUNT", 0),
    }


def _choose_backend(backend: str | None) -> str:
    cuda = torch.cuda.is_available()
    if backend is None:
        return "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if not isinstance(backend, str) or not backend:
        raise ConfigError(f"backend must be a non-empty string such as 'gloo', got {backend!r}")
    if "nccl" in backend and not cuda:
        raise ConfigError(f"backend {backend!r} needs CUDA, which is not available here; "
                          "use backend='gloo' (or None to choose automatically)")
    return backend


def _choose_device(backend: str, local_rank: int) -> torch.device:
    if "nccl" not in backend:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are "
                          "visible; start at most that many processes per node")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _open_log(event_log: str | os.PathLike[str] | EventLog | None,
              rank: int) -> tuple[EventLog | None, bool]:
    if event_log is None or isinstance(event_log, EventLog):
        return event_log, False
    if not isinstance(event_log, (str, os.PathLike)):
        raise ConfigError(f"event_log must be a path or an EventLog, got {event_log!r}")
    return EventLog(event_log, rank=rank), True


# --- store ------------------------------------------------------------------------------------

def _base_store(env: dict[str, Any], timeout: timedelta) -> dist.Store:
    """The job's store: torchrun's (agent-hosted or rank-0-hosted), or a private loopback one."""
    if not env["launched"]:
        return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    store, _, _ = next(dist.rendezvous("env://", rank=env["rank"],
                                       world_size=env["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    return store


def _agree_incarnation(store: dist.Store, rank: int, world_size: int,
                       timeout: timedelta) -> str:
    """Return an id that every rank of this incarnation shares and no earlier one used.

    Protocol (keys under ``tierckpt/join/``; leftovers from earlier incarnations are harmless):
    rank r > 0 sets ``nonce/<r>`` to a fresh nonce and polls ``grant/<r>`` until it holds that
    nonce; rank 0 draws a fresh id, answers every nonce it reads with ``grant/<r>`` =
    ``{nonce, id}``, and repeats until ``ack/<id>`` counts world_size - 1. Rank r adds to
    ``ack/<id>`` after accepting its grant.
    """
    if world_size == 1:
        return uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        return _lead(store, world_size, deadline, timeout)
    return _follow(store, rank, deadline, timeout)


def _lead(store: dist.Store, world_size: int, deadline: float, timeout: timedelta) -> str:
    incarnation = uuid.uuid4().hex
    nonce_keys = [f"{_NAMESPACE}/join/nonce/{r}" for r in range(1, world_size)]
    ack_key = f"{_NAMESPACE}/join/ack/{incarnation}"
    granted: dict[int, bytes] = {}
    poll = _POLL_MIN_S
    while True:
        nonces = _read_present(store, nonce_keys)
        for i, nonce in nonces.items():
            if granted.get(i + 1) != nonce:
                grant = {"nonce": nonce.decode(), "incarnation": incarnation}
                store.set(f"{_NAMESPACE}/join/grant/{i + 1}", json.dumps(grant))
                granted[i + 1] = nonce
        acked = store.add(ack_key, 0)
        if acked >= world_size - 1:
            return incarnation
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank 0: only {acked} of {world_size - 1} other ranks joined within "
                f"{timeout}; a rank did not start or cannot reach the store")
        time.sleep(poll)
        poll = min(poll * 2, _POLL_MAX_S)


def _read_present(store: dist.Store, keys: list[str]) -> dict[int, bytes]:
    """Values of those ``keys`` that exist, by index. Two round trips once all exist (the
    usual case after the first incarnation, whose leftovers are still there); one per key
    before that, since ``multi_get`` would block on a missing key."""
    if store.check(keys):
        return dict(enumerate(store.multi_get(keys)))
    return {i: store.get(k) for i, k in enumerate(keys) if store.check([k])}


def _follow(store: dist.Store, rank: int, deadline: float, timeout: timedelta) -> str:
    nonce = uuid.uuid4().hex
    store.set(f"{_NAMESPACE}/join/nonce/{rank}", nonce)
    grant_key = f"{_NAMESPACE}/join/grant/{rank}"
    poll = _POLL_MIN_S
    while True:
        if store.check([grant_key]):
            grant = json.loads(store.get(grant_key))
            if grant.get("nonce") == nonce:
                incarnation = str(grant["incarnation"])
                store.add(f"{_NAMESPACE}/join/ack/{incarnation}", 1)
                return incarnation
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank {rank}: rank 0 did not answer within {timeout}; it did not start or "
                "cannot reach the store")
        time.sleep(poll)
        poll = min(poll * 2, _POLL_MAX_S)
