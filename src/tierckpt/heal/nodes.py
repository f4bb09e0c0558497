"""``tierckpt run --heal --nnodes MIN[:MAX]``: one node of a multi-node job, a supervisor on
every node, the job's store in etcd (:class:`tierckpt.runtime.etcdstore.EtcdStore`), so that
losing any node — the first one included — heals like any other (issue 43).

The nodes meet in the store (:mod:`tierckpt.heal.membership`): each registers and
heartbeats; the first MIN to take a slot (``compare_set``) run group ranks 0..MIN-1, node s
the global ranks s*P .. s*P + P - 1 of a world of MIN*P (P = ``--nproc-per-node``); the
others wait as warm spare nodes, P pre-warmed workers each. Every worker gets torchrun's
environment with its global rank, ``GROUP_RANK`` = its slot, and the store
(``TIERCKPT_STORE``: :func:`tierckpt.runtime.incarnation.base_store` builds it). The
incarnation id is ``<job>.<n>``, n the job's full restarts, agreed in the store.

What each node does, beside what :class:`~tierckpt.heal.launcher.HealLauncher` does for its
own workers:

- **A rank dies on a live node**: its supervisor opens the next generation as on one node,
  but with ``compare_set`` on ``gen`` (two nodes opening one generation at once both join
  it, each replacing its own dead ranks, merged into ``dead/<g>`` by ``compare_set``); the
  other nodes follow the store's ``gen`` and treat the heal as theirs (a death of their own
  during it is a full restart).
- **A node is lost** (no heartbeat for ``detect_s``, or for ``suspect_s``, four heartbeats,
  once survivors are leaving the generation — their collectives with it failed — and none of
  its own ranks is among them: those show it alive, its heartbeat late): a spare
  node takes its slot (``compare_set(slot/<s>, lost, spare)``: one spare wins), opens
  generation g + 1 with that slot's ranks dead and starts them; the survivors on every
  other node keep their processes and heal. When generation g was not whole, or no spare
  node waits (once the node is lost; or three times ``detect_s`` after, with spares that do
  not take it), the slot is freed and the job restarts in full, every node waiting until
  every slot is held again.
- **A full restart** is ``compare_set(inc, n, n + 1)``; every supervisor sees it, kills its
  workers and starts incarnation n + 1 once every slot is held.
- **A fenced node**: a supervisor that finds its slot held by another node (it was seen
  lost) kills its workers and waits as a spare: ranks never run twice.
- **The end**: the first node whose workers end records the job's status (``done``); spare
  nodes then exit with it, and a node that gives up (``max_restarts``) ends every node.
  The last node out clears the job's keys from etcd, all but ``done`` and ``closed``.

Not done here: a rendezvous id is one job (use a fresh ``--rdzv-id``), a world smaller
than MIN*P (no reshard), and more than one slot per node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from tierckpt.errors import ConfigError
from tierckpt.heal import membership
from tierckpt.heal.launcher import _FORWARDED, HealLaunch, HealLauncher, _Incarnation
from tierckpt.heal.membership import BEAT_S, Membership
from tierckpt.heal.spares import SparePool
from tierckpt.preempt.config import EXIT_PREEMPTED
from tierckpt.runtime import healenv, orphan

_RESTART = 1001  # internal statuses of one incarnation, never a worker's exit code
_FENCED = 1002
_POLL_S = 0.1  # how often a node reads the store for the others' say


@dataclass(frozen=True, kw_only=True)
class NodeLaunch:
    """One node of a multi-node job: the per-node ``launch`` (its ``nproc`` workers, heals,
    restarts), ``min_nodes`` running nodes and up to ``max_nodes`` with the spare nodes,
    the job's etcd ``endpoints`` (client URLs) and ``job`` id, this ``node``'s id (unique in
    the job), ``detect_s`` without a heartbeat before a node counts as lost (sooner with
    evidence: :attr:`suspect_s`), and ``join_timeout_s`` for every slot to be held."""

    launch: HealLaunch
    min_nodes: int
    max_nodes: int
    endpoints: str
    job: str
    node: str
    detect_s: float = 3.0
    join_timeout_s: float = 600.0

    @property
    def suspect_s(self) -> float:
        """Silence that is a loss with evidence (see ``_lost``): four heartbeats."""
        return min(self.detect_s, 4 * BEAT_S)

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.max_nodes}: need "
                              "1 <= MIN <= MAX")
        for name in ("job", "node"):
            v = getattr(self, name)
            if not v or "/" in v:
                raise ConfigError(f"--{'rdzv-id' if name == 'job' else 'node-id'} {v!r}: "
                                  "give a non-empty name without '/'")
        for name in ("detect_s", "join_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"NodeLaunch.{name} must be seconds > 0")
        if not self.launch.heal:
            raise ConfigError("--nnodes runs with --heal only (a multi-node job without "
                              "heals is torchrun's)")


def default_node_id() -> str:
    """This host's name and this process's id: unique on a cluster."""
    return f"{socket.gethostname()}-{os.getpid()}"


class NodeSupervisor(HealLauncher):
    """The supervisor of one node (see the module docstring); :meth:`run` returns the job's
    exit status as this node saw it."""

    def __init__(self, command: Sequence[str], config: NodeLaunch,
                 say: Callable[[str], None] | None = None) -> None:
        from tierckpt.runtime.etcdstore import EtcdStore

        store = EtcdStore(config.endpoints, config.job, timeout=timedelta(seconds=30),
                          compact_every_s=300.0)  # etcd's history: 5 min kept
        super().__init__(command, config.launch, say or (lambda line: print(
            f"tierckpt run [{config.node}]: {line}", file=sys.stderr, flush=True)), store=store)
        self.nodes = config
        self.world = config.min_nodes * config.launch.nproc
        self.slot: int | None = None
        if store.check([membership.key("done")]):
            store.close()
            self._spares.close()
            raise ConfigError(f"--rdzv-id {config.job!r}: a job under this id already ended "
                              "(its keys are in the store); give every job a fresh id")
        self.members = Membership(store, config.node, detect_s=config.detect_s)
        self._next_poll = 0.0
        self._stale: dict[int, float] = {}  # slot -> when its holder was first seen lost

    def run(self) -> int:
        """Join the job, run or wait as a spare node, until the job ends."""
        previous = {s: signal.signal(s, self._on_signal) for s in _FORWARDED}
        try:
            status = self._run()
            self._close_job(status)
            return status
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._spares.close()
            self.members.close()
            self.store.close()

    def _run(self) -> int:
        self.slot = next((s for s in range(self.nodes.min_nodes)
                          if self.members.claim(s)), None)
        while True:
            inc: _Incarnation | None = None
            if self.slot is None:
                got = self._wait_as_spare()
                if got is not None and not isinstance(got, _Incarnation):
                    return got
                inc = got
            if inc is not None:
                status = self._supervise(inc)
                n = inc.restart
            else:
                n = self.members.incarnation()
                self._say(f"slot {self.slot}: ranks {list(self._ranks())}, incarnation {n}")
                gathered = self._gather(n)
                status = self._incarnation(n) if gathered is None else gathered
            if status in (0, EXIT_PREEMPTED) or self._signal is not None:
                self.members.end(status)
                return status
            if status == _FENCED:
                self._say(f"slot {self.slot} is held by another node now (this one was seen "
                          "lost): its workers stopped; waiting as a spare node")
                self.slot = None
            elif status != _RESTART:
                done = self.members.done()
                if done is not None:
                    return done
                if n >= self.config.max_restarts:
                    self._say(f"giving up after {n} full restarts (exit {status})")
                    self.members.end(status)
                    return status
                self.members.restart(n)
                self._say(f"full restart {n + 1} of {self.config.max_restarts}")

    def _close_job(self, status: int) -> None:
        """The last node out clears the job's keys from etcd, keeping its end (``done``)
        and who cleared (``closed``): a job leaves two keys behind, not thousands. Best
        effort: the job's status stands whatever etcd answers."""
        try:
            if not self.members.leave():
                return
            done = self.members.done()
            n = self.store.clear(keep={membership.key("done"): str(
                status if done is None else done), membership.key("closed"): self.nodes.node})
        except Exception as e:  # the store is out: the keys stay, the job ended all the same
            self._say(f"the job's keys stay in etcd (clearing them failed: {e})")
            return
        self._say(f"the job's {n} keys cleared from etcd (its end kept under nodes/done)")

    # -- one incarnation across nodes ------------------------------------------------------
    def _inc_id(self, n: int) -> str:
        return f"{self.nodes.job}.{n}"

    def _new_incarnation(self, restart: int) -> _Incarnation:
        inc = _Incarnation(id=self._inc_id(restart), restart=restart)
        self.store.compare_set(self._key(inc, "gen"), "", "0")
        self.store.compare_set(self._key(inc, "dead/0"), "", "[]")
        return inc

    def _ranks(self, slot: int | None = None) -> range:
        """The global ranks of ``slot`` (this node's by default)."""
        s, p = self.slot if slot is None else slot, self.config.nproc
        assert s is not None
        return range(s * p, s * p + p)

    def _gather(self, n: int) -> int | None:
        """Wait until every slot is held (None), or the job moved on (a status)."""
        deadline, said = time.monotonic() + self.nodes.join_timeout_s, False
        while True:
            if (status := self._moved_on(n)) is not None:
                return status
            free = [s for s in range(self.nodes.min_nodes) if not self.members.owner(s)]
            if not free:
                return None
            if time.monotonic() > deadline:
                self._say(f"slot(s) {free} not held after {self.nodes.join_timeout_s:g} s")
                return 1
            if not said:
                self._say(f"waiting for nodes to hold slot(s) {free}")
                said = True
            time.sleep(_POLL_S)

    def _moved_on(self, n: int) -> int | None:
        """A status when the job left incarnation ``n`` or fenced this node off, else None."""
        done = self.members.done()
        if done is not None and done not in (0, EXIT_PREEMPTED):  # those: ours end alike
            self._say(f"another node ended the job (exit {done})")
            return done
        if self.members.incarnation() != n:
            self._say(f"full restart: another node started incarnation "
                      f"{self.members.incarnation()}")
            return _RESTART
        if self.slot is not None and self.members.owner(self.slot) != self.nodes.node:
            return _FENCED
        return None

    def _cluster(self, inc: _Incarnation) -> int | None:
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + _POLL_S
        if (status := self._moved_on(inc.restart)) is not None:
            return status
        gen = int(self.store.get(self._key(inc, "gen")))
        if gen > inc.gen:
            self._say(f"generation {gen} opened by another node: healing with it")
            inc.gen = gen
            if inc.healing is None or inc.healing[0] < gen:
                inc.healing, inc.replaced = (gen, now), set()
        if self.members.done() is None:
            return self._watch_nodes(inc, now)
        return None

    def _watch_nodes(self, inc: _Incarnation, now: float) -> int | None:
        """A full restart when a node was lost and no spare node takes its slot in time."""
        for s in range(self.nodes.min_nodes):
            holder = self.members.owner(s)
            if s == self.slot or not holder or not self._lost(holder, s, inc.restart):
                self._stale.pop(s, None)
                continue
            first = self._stale.setdefault(s, now)
            spares = self.members.spares(self.nodes.min_nodes)
            if spares and now - first < 3 * self.nodes.detect_s:
                continue
            if not self.members.release(s, holder):  # a spare took it since: its heal
                continue
            self._say(f"node {holder} (slot {s}) lost and " + (
                "no spare node took it" if spares else "no spare node waits") + ": full restart")
            self.members.restart(inc.restart)
            self._stale.clear()
            return _RESTART
        return None

    def _lost(self, holder: str, slot: int, n: int | None = None) -> bool:
        """Whether ``holder`` (of ``slot``) is lost: silent for ``detect_s``, or for
        ``suspect_s`` while survivors of the job's generation are leaving it (their
        collectives failed: the evidence that a peer is gone, so the wait for the full
        timeout is cut short) and none of them is one of ``holder``'s ranks (a node whose
        own ranks left is alive, its heartbeat late: a store election or a stall)."""
        silent = self.members.silent(holder)
        if silent >= self.nodes.detect_s:
            return True
        if silent < self.nodes.suspect_s:
            return False
        inc = _Incarnation(id=self._inc_id(self.members.incarnation() if n is None else n),
                           restart=0)
        if not self.store.check([k := self._key(inc, "gen")]):
            return False
        g = int(self.store.get(k))
        return self.store.check([self._key(inc, f"leaving/{g}")]) and not any(self.store.check(
            [self._key(inc, f"left/{g}/{r}")]) for r in self._ranks(slot))

    # -- generations opened by several nodes -----------------------------------------------
    def _publish_generation(self, inc: _Incarnation, dead: list[int]) -> None:
        self._add_dead(inc, inc.gen, dead)
        got = int(self.store.compare_set(self._key(inc, "gen"), str(inc.gen - 1),
                                         str(inc.gen)))
        if got > inc.gen:  # another node opened a later one meanwhile: join that one
            inc.gen = got
            self._add_dead(inc, got, dead)

    def _add_dead(self, inc: _Incarnation, gen: int, ranks: list[int]) -> None:
        """Merge ``ranks`` into ``dead/<gen>`` (``compare_set``: several nodes may add)."""
        k = self._key(inc, f"dead/{gen}")
        while True:
            cur = self.store.get(k).decode() if self.store.check([k]) else ""
            new = json.dumps(sorted({*json.loads(cur or "[]"), *ranks}))
            if self.store.compare_set(k, cur, new).decode() == new:
                return

    def _env(self, inc: _Incarnation, rank: int) -> dict[str, str]:
        assert self.slot is not None
        host, _, port = self.nodes.endpoints.split(",")[0].removeprefix(
            "http://").rpartition(":")
        return {**super()._env(inc, rank),
                "LOCAL_RANK": str(rank - self.slot * self.config.nproc),
                "WORLD_SIZE": str(self.world), "ROLE_WORLD_SIZE": str(self.world),
                "GROUP_RANK": str(self.slot), "GROUP_WORLD_SIZE": str(self.nodes.min_nodes),
                "MASTER_ADDR": host, "MASTER_PORT": port,
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                orphan.ENV: os.environ.get(orphan.ENV) or "kill",  # see runtime/orphan.py
                healenv.ENV_STORE: healenv.store_url(self.nodes.endpoints),
                healenv.ENV_STORE_JOB: self.nodes.job}

    def _joins_open_heal(self, inc: _Incarnation, ranks: list[int]) -> bool:
        """Whether the lost node's ``ranks`` may join the heal open now (generation g, not
        yet whole): the generation before it was whole and none of them left it (they died
        with it, as nodes lost together do), so they take no part in forming g yet; as one
        node adds a rank that died before leaving."""
        g = inc.gen
        if g == 0 or self._ready(inc, g - 1) < self.world:
            return False
        return not any(self.store.check([self._key(inc, f"left/{g - 1}/{r}")]) for r in ranks)

    # -- a spare node ----------------------------------------------------------------------
    def _wait_as_spare(self) -> int | _Incarnation | None:
        """Wait for a slot: a free one (None: the next incarnation starts with it), a lost
        node's (the heal's incarnation, its workers started), or the job's end (a status)."""
        extra = self.nodes.max_nodes - self.nodes.min_nodes
        if len(self.members.spares(self.nodes.min_nodes)) >= extra:
            self._say(f"more nodes than --nnodes {self.nodes.min_nodes}:"
                      f"{self.nodes.max_nodes} allows: this one leaves")
            return 1
        self._say("every slot is held: waiting as a spare node")
        self._spares.close()
        self._spares = SparePool(self.command, max(self.config.spares, self.config.nproc))
        self._spare_wait_s = 10.0  # a node's takeover: its warm workers beat cold ones
        while True:
            if self._signal is not None:
                return 128 + self._signal
            done = self.members.done()
            if done is not None:
                return done
            for s in range(self.nodes.min_nodes):
                holder = self.members.owner(s)
                if not holder:
                    if self.members.claim(s):
                        self.slot = s
                        return None
                elif holder != self.nodes.node and self._lost(holder, s) \
                        and self.members.claim(s, holder):
                    self.slot = s
                    return self._take_over(holder)
            time.sleep(_POLL_S)

    def _take_over(self, lost: str) -> _Incarnation | None:
        """Run the lost node's ranks: open the next generation with them dead and start
        them in it (the incarnation to supervise), or ask for a full restart (None) when the
        generation was not whole."""
        n = self.members.incarnation()
        inc = _Incarnation(id=self._inc_id(n), restart=n)
        k = self._key(inc, "gen")
        inc.gen = int(self.store.get(k)) if self.store.check([k]) else 0
        ranks = list(self._ranks())
        if self._ready(inc, inc.gen) >= self.world and self.heals < self.config.max_heals:
            inc.gen += 1
            self.heals += 1
            self._publish_generation(inc, ranks)
        elif self._joins_open_heal(inc, ranks):
            self._add_dead(inc, inc.gen, ranks)
        else:
            self._say(f"node {lost} lost before generation {inc.gen} was whole: full restart")
            self.members.restart(n)
            return None
        self._say(f"node {lost} lost: slot {self.slot}, ranks {ranks} taken over here; "
                  f"healing: generation {inc.gen}")
        for r in ranks:
            inc.workers[r] = self._start(inc, r, spare=True)
        inc.healing, inc.replaced = (inc.gen, time.monotonic()), set(ranks)
        return inc
