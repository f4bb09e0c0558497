"""The start-up handshake: every incarnation of a job agrees, through the job's store, on
a fresh id, and puts its process-group keys under ``tierckpt/<id>/`` (:func:`pg_prefix`).

:func:`base_store` is the job's store (torchrun's, or a private loopback one);
:func:`agree_incarnation` returns the id all ranks of this start share and no earlier start
used, or raises :class:`~tierckpt.errors.CheckpointError` when a rank does not show up
within the timeout. Used by :func:`tierckpt.runtime.distributed.init_distributed`.

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

import json
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tierckpt.errors import CheckpointError
from tierckpt.runtime import healenv

_NAMESPACE = "tierckpt"
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.1


def pg_prefix(incarnation: str) -> str:
    """The store prefix of the process-group keys of ``incarnation``."""
    return f"{_NAMESPACE}/{incarnation}/"


def base_store(env: dict[str, Any], timeout: timedelta) -> dist.Store:
    """The job's store: the etcd store a multi-node ``tierckpt run`` names in the
    environment (:data:`tierckpt.runtime.healenv.ENV_STORE`), torchrun's (agent-hosted or
    rank-0-hosted), or a private loopback one."""
    shared = healenv.read_store()
    if shared is not None:
        from tierckpt.runtime.etcdstore import EtcdStore  # only multi-node heal jobs

        endpoints, job = shared
        return EtcdStore(endpoints, job, timeout=timeout)
    if not env["launched"]:
        return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    store, _, _ = next(dist.rendezvous("env://", rank=env["rank"],
                                       world_size=env["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    return store


def agree_incarnation(store: dist.Store, rank: int, world_size: int,
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
