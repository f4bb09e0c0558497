"""``tierckpt run --heal``: a torchrun-compatible launcher (one node) that replaces a dead
worker instead of restarting the whole group (docs/heal.md).

It hosts the job's store, starts ``nproc`` workers with torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, and ``TORCHELASTIC_USE_AGENT_STORE`` so every worker is a
client of its store) plus the heal contract (:mod:`tierckpt.runtime.healenv`), and watches
them:

- every worker exits 0 → the job is done (0); one exits 75 (preempted, saved) → it waits for
  the others and ends with 75, as after a notice under torchrun;
- a worker dies while its generation is whole (every rank counted ``ready``) → a **heal**:
  after ``settle_s`` (deaths seen together are one heal) it opens generation g + 1
  naming the dead ranks and starts their replacements in it — a pre-warmed spare when one
  waits (:mod:`tierckpt.heal.spares`), else a fresh process; the survivors re-form the group
  with them (:meth:`tierckpt.CheckpointManager.heal`). The spare taken is replaced only
  once every rank of the healed generation has completed a step (``stepped/<g>``), or
  ``timeout_s`` after it was whole, so a new spare's imports never compete with the heal
  or its first step for the node's CPUs. A survivor that has not left the failed
  generation (``left/<g>/<rank>``) ``stuck_s`` after the heal opened is blocked where no
  error reaches it — gloo does not wake a send pending to a peer that stopped reading, and
  it waits out the group's timeout — so it is SIGKILLed and replaced in the same heal: every
  rank reloads the newest checkpoint anyway, and it loses only its warm process. A survivor
  that dies before it left is replaced in the same heal too (deaths that came together but
  were seen further apart than ``settle_s`` on a loaded node);
- anything else — a death during a heal (a rank that began it, or a replacement), before
  the generation was whole, past ``max_heals``, or a heal not whole after ``timeout_s`` → a
  **full restart**: SIGKILL every worker left, start all again in a new incarnation, up to
  ``max_restarts`` times, as torchrun does.

SIGTERM, SIGINT and SIGUSR1 sent to the launcher are passed to every worker (a notice under
Slurm or Kubernetes), and the launcher waits for them. Its own lines go to stderr, prefixed
``tierckpt run:``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.heal.spares import SparePool
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime import healenv
from tierckpt.runtime.nodespec import FORWARDED

_POLL_S = 0.02
_FORWARDED = tuple(signal.Signals[name] for name in FORWARDED)


@dataclass(frozen=True, kw_only=True)
class HealLaunch:
    """How ``tierckpt run`` supervises: ``nproc`` workers; at most ``max_heals`` heals and
    ``max_restarts`` full restarts; ``spares`` pre-warmed processes (0: replacements start
    cold); ``timeout_s`` for a heal to be whole (and for survivors to see the next
    generation); ``settle_s`` to gather deaths into one heal (short: a survivor that dies
    later, before it began the heal, joins it anyway); ``stuck_s`` for a survivor
    to leave the failed generation before it is replaced too; ``heal=False`` is plain
    torchrun behaviour (every death a full restart)."""

    nproc: int
    heal: bool = True
    max_heals: int = 100
    max_restarts: int = 3
    spares: int = 1
    timeout_s: float = healenv.DEFAULT_TIMEOUT_S
    settle_s: float = 0.02
    stuck_s: float = 10.0
    port: int = 0

    def __post_init__(self) -> None:
        for name in ("nproc", "max_heals", "max_restarts", "spares", "port"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "nproc"
                                                                    else 0):
                raise ConfigError(f"HealLaunch.{name} must be an int >= "
                                  f"{1 if name == 'nproc' else 0}, got {v!r}")
        for name in ("timeout_s", "settle_s", "stuck_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(f"HealLaunch.{name} must be seconds > 0, got {v!r}")


@dataclass
class _Incarnation:
    """One full start of the job: its id, the generation open now, the workers by rank,
    and the heal in progress (the generation being formed and when it was opened)."""

    id: str
    restart: int
    gen: int = 0
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    healing: tuple[int, float] | None = None
    refill: tuple[int, float] | None = None  # a healed generation, when whole: spares wait
    replaced: set[int] = field(default_factory=set)  # ranks started for the open heal


class HealLauncher:
    """Runs one job; :meth:`run` returns its exit status. ``say`` receives the launcher's
    lines (default: stderr)."""

    def __init__(self, command: Sequence[str], config: HealLaunch,
                 say: Callable[[str], None] | None = None, *, store: Any = None) -> None:
        if not command:
            raise ConfigError("tierckpt run: give the training command after --")
        self.command, self.config = list(command), config
        self._say = say or (lambda line: print(f"tierckpt run: {line}", file=sys.stderr,
                                               flush=True))
        if store is None:
            import torch.distributed as dist  # the store server: torch, as torchrun needs

            store = dist.TCPStore("127.0.0.1", config.port, is_master=True,
                                  wait_for_workers=False, timeout=timedelta(minutes=5))
        self.store = store
        self.port = int(getattr(store, "port", 0))
        self.world = config.nproc  # ranks in the job (every node's, across nodes)
        self._spare_wait_s = 0.0  # for a spare still importing, before starting one cold
        self.heals = 0
        self.restarts = 0
        self._signal: int | None = None
        self._spares = SparePool(self.command, config.spares if config.heal else 0)

    def run(self) -> int:
        """Start the workers and supervise them until the job ends (see the module doc)."""
        previous = {s: signal.signal(s, self._on_signal) for s in _FORWARDED}
        try:
            while True:
                status = self._incarnation(self.restarts)
                if status in (0, EXIT_PREEMPTED) or self._signal is not None:
                    return status
                if self.restarts >= self.config.max_restarts:
                    self._say(f"giving up after {self.restarts} full restarts (exit {status})")
                    return status
                self.restarts += 1
                self._say(f"full restart {self.restarts} of {self.config.max_restarts}")
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._spares.close()

    # -- one incarnation -------------------------------------------------------------------
    def _incarnation(self, restart: int) -> int:
        inc = self._new_incarnation(restart)
        for r in self._ranks():
            inc.workers[r] = self._start(inc, r, spare=False)
        return self._supervise(inc)

    def _new_incarnation(self, restart: int) -> _Incarnation:
        """A fresh start of the job, its generation 0 opened in the store."""
        inc = _Incarnation(id=uuid.uuid4().hex[:16], restart=restart)
        self.store.set(self._key(inc, "gen"), "0")
        self.store.set(self._key(inc, "dead/0"), "[]")
        return inc

    def _ranks(self) -> range:
        """The global ranks this launcher's node runs."""
        return range(self.config.nproc)

    def _supervise(self, inc: _Incarnation) -> int:
        """Watch ``inc``'s workers until it ends; every worker left is killed after."""
        self._spares.fill()  # one a heal took before a full restart: not waited for now
        try:
            return self._watch(inc)
        finally:
            self._stop(inc.workers.values())

    def _cluster(self, inc: _Incarnation) -> int | None:
        """The other nodes' say, polled with the workers: an exit status that ends ``inc``
        now, or None. One node: none."""
        del inc
        return None

    def _watch(self, inc: _Incarnation) -> int:
        handled: set[int] = set()  # pids whose exit was acted on
        while True:
            time.sleep(_POLL_S)
            if self._signal is not None:
                self._forward(inc, self._signal)
                return self._wait_all(inc)
            if (status := self._cluster(inc)) is not None:
                return status
            codes = {r: p.poll() for r, p in inc.workers.items()}
            if all(c == 0 for c in codes.values()):
                return 0
            if any(c == EXIT_PREEMPTED for c in codes.values()):
                return self._wait_all(inc)
            dead = sorted(r for r, c in codes.items()
                          if c not in (None, 0) and inc.workers[r].pid not in handled)
            if inc.healing is not None:
                gen, opened = inc.healing
                late = [r for r in dead if not self._left(inc, r)]
                if late:  # died before it began the heal: as if it had died with the others
                    self._say(f"rank(s) {late} died before leaving generation {gen - 1}: "
                              "replacing them in the same heal")
                    self._replace(inc, late, handled)
                if during := [r for r in dead if r not in late]:
                    self._say(f"rank(s) {during} died during the heal of generation {gen}: "
                              "falling back to a full restart")
                    return 1
                self._replace_stuck(inc, handled)
                if self._ready(inc, gen) >= self.world:
                    self._say(f"generation {gen} healed in {time.monotonic() - opened:.2f} s")
                    inc.healing, inc.refill = None, (gen, time.monotonic())
                elif time.monotonic() - opened > self.config.timeout_s:
                    self._say(f"generation {gen} not whole after {self.config.timeout_s:.0f} "
                              "s: falling back to a full restart")
                    return 1
                continue
            self._refill(inc)
            if not dead:
                continue
            why = self._unhealable(inc, codes)
            if why:
                self._say(f"rank(s) {dead} exited ({[codes[r] for r in dead]}); {why}: "
                          "full restart")
                return 1
            dead = self._settle(inc, handled)
            handled.update(inc.workers[r].pid for r in dead)
            self._open_generation(inc, dead)

    def _replace_stuck(self, inc: _Incarnation, handled: set[int]) -> None:
        """SIGKILL and replace, in the open heal, every survivor that has not left the
        failed generation ``stuck_s`` after the heal opened (see the module doc)."""
        assert inc.healing is not None
        gen, opened = inc.healing
        if time.monotonic() - opened < self.config.stuck_s:
            return
        stuck = [r for r in sorted(inc.workers) if not self._left(inc, r)]
        if not stuck:
            return
        self._say(f"rank(s) {stuck} did not leave generation {gen - 1} within "
                  f"{self.config.stuck_s:g} s (blocked in a collective): replacing them too")
        self._replace(inc, stuck, handled)

    def _left(self, inc: _Incarnation, rank: int) -> bool:
        """Whether ``rank`` is out of the failed generation: started for the open heal, or
        a survivor that began it (``left/<g - 1>/<rank>``)."""
        assert inc.healing is not None
        return rank in inc.replaced or self.store.check(
            [self._key(inc, f"left/{inc.healing[0] - 1}/{rank}")])

    def _replace(self, inc: _Incarnation, ranks: list[int], handled: set[int]) -> None:
        """Add ``ranks`` (survivors that never began the heal: dead, or SIGKILLed here) to
        the open heal's dead set and start their replacements in its generation. Safe: they
        took no part in forming it, and every rank reloads the newest checkpoint anyway."""
        assert inc.healing is not None
        gen = inc.healing[0]
        for r in ranks:
            old = inc.workers[r]
            with contextlib.suppress(ProcessLookupError):
                old.kill()
            old.wait()
            handled.add(old.pid)
        self._add_dead(inc, gen, ranks)
        for r in ranks:
            inc.workers[r] = self._start(inc, r, spare=True)
        inc.replaced.update(ranks)

    def _add_dead(self, inc: _Incarnation, gen: int, ranks: list[int]) -> None:
        """Add ``ranks`` to ``dead/<gen>``."""
        dead = sorted({*json.loads(self.store.get(self._key(inc, f"dead/{gen}"))), *ranks})
        self.store.set(self._key(inc, f"dead/{gen}"), json.dumps(dead))

    def _refill(self, inc: _Incarnation) -> None:
        """Replace the spares a heal took once its generation has stepped (see the module
        doc)."""
        if inc.refill is None:
            return
        gen, whole = inc.refill
        stepped = int(self.store.add(self._key(inc, f"stepped/{gen}"), 0))
        if stepped >= self.world or time.monotonic() - whole > self.config.timeout_s:
            inc.refill = None
            self._spares.fill()

    def _unhealable(self, inc: _Incarnation, codes: dict[int, int | None]) -> str | None:
        if not self.config.heal:
            return "healing is off"
        if self.heals >= self.config.max_heals:
            return f"{self.heals} heals done (max_heals)"
        if all(c is not None for c in codes.values()):
            return "no rank survived"
        if self._ready(inc, inc.gen) < self.world:
            return f"generation {inc.gen} never loaded its state on every rank"
        return None

    def _settle(self, inc: _Incarnation, handled: set[int]) -> list[int]:
        """Wait ``settle_s`` so deaths that come together are healed together."""
        time.sleep(self.config.settle_s)
        return sorted(r for r, p in inc.workers.items()
                      if p.poll() not in (None, 0) and p.pid not in handled)

    def _open_generation(self, inc: _Incarnation, dead: list[int]) -> None:
        inc.gen += 1
        self.heals += 1
        self._publish_generation(inc, dead)
        self._say(f"rank(s) {dead} died; healing: generation {inc.gen}")
        for r in dead:
            inc.workers[r] = self._start(inc, r, spare=True)
        inc.healing, inc.replaced = (inc.gen, time.monotonic()), set(dead)

    def _publish_generation(self, inc: _Incarnation, dead: list[int]) -> None:
        """Open generation ``inc.gen`` in the store, replacing ``dead``."""
        self.store.set(self._key(inc, f"dead/{inc.gen}"), json.dumps(dead))
        self.store.set(self._key(inc, "gen"), str(inc.gen))  # last: survivors read dead/<g>

    # -- workers ---------------------------------------------------------------------------
    def _env(self, inc: _Incarnation, rank: int) -> dict[str, str]:
        """torchrun's environment for ``rank`` and the heal contract."""
        n = self.config.nproc
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(n), "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "TORCHELASTIC_RESTART_COUNT": str(inc.restart),
                "TORCHELASTIC_MAX_RESTARTS": str(self.config.max_restarts),
                "TORCHELASTIC_RUN_ID": inc.id, "TORCHELASTIC_USE_AGENT_STORE": "True",
                healenv.ENV_ID: inc.id, healenv.ENV_GEN: str(inc.gen),
                healenv.ENV_TIMEOUT: str(self.config.timeout_s)}

    def _start(self, inc: _Incarnation, rank: int, *, spare: bool) -> subprocess.Popen[bytes]:
        env = self._env(inc, rank)
        proc = self._spares.take(env, self._spare_wait_s) if spare else None
        if proc is None:
            proc = subprocess.Popen(self.command, env={**os.environ, **env})
        return proc

    def _ready(self, inc: _Incarnation, gen: int) -> int:
        return int(self.store.add(self._key(inc, f"ready/{gen}"), 0))

    def _key(self, inc: _Incarnation, name: str) -> str:
        return healenv.HealEnv(inc.id, inc.gen).key(name)

    def _forward(self, inc: _Incarnation, sig: int) -> None:
        for p in inc.workers.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    def _wait_all(self, inc: _Incarnation) -> int:
        """Wait for every worker; the job's status: 0 if all were 0, else the first other."""
        codes = [p.wait() for p in inc.workers.values()]
        return next((c for c in codes if c != 0), 0)

    def _stop(self, procs: Iterable[subprocess.Popen[bytes]]) -> None:
        """SIGKILL what is left: a full restart resumes from committed checkpoints only, and
        a survivor waiting in a heal would take a SIGTERM for a termination notice (armed
        by ``should_stop``) and wait on."""
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.kill()
        for p in alive:
            p.wait()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self._signal = signum
