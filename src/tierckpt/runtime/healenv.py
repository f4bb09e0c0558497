"""The contract between ``tierckpt run --heal`` (the launcher) and the processes it starts:
environment variables in, store keys between them. Torch-free (the launcher's CLI reads it).

A job started by the heal launcher has ``TIERCKPT_HEAL_ID`` (fresh for every full start of
the job: the incarnation) and ``TIERCKPT_HEAL_GEN`` (the generation this process joins: 0 at
a full start, g after the g-th heal). Every process group of generation g lives under the
store prefix :func:`pg_prefix`, so a group of an earlier generation — one with a dead member
— is never read again.

Store keys, all under ``tierckpt/heal/<id>/``:

==================  ==========================================================================
``gen``             the newest generation the launcher opened (a decimal string)
``dead/<g>``        the ranks replaced in generation g (JSON list)
``ready/<g>``       a counter: ranks of generation g whose state is loaded (a restore done);
                    at ``world_size`` the generation is whole and a later death can be healed
``left/<g>/<r>``     set by survivor r when it leaves the failed generation g (its heal
                    began); one that has not, ``stuck_s`` after the heal opened, is replaced
``leaving/<g>``     a counter: survivors that left generation g (across nodes: a node whose
                    heartbeat paused while its peers' collectives failed is lost sooner)
``stepped/<g>``     a counter: ranks of generation g that completed a step (the launcher then
                    starts the spares the heal took)
==================  ==========================================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tierckpt.errors import ConfigError

ENV_ID = "TIERCKPT_HEAL_ID"
ENV_GEN = "TIERCKPT_HEAL_GEN"
ENV_TIMEOUT = "TIERCKPT_HEAL_TIMEOUT_S"
ENV_STORE = "TIERCKPT_STORE"
"""The job's store when it is not torchrun's: ``etcd://host:port[,host:port...]`` (set by a
multi-node ``tierckpt run``, whose store must outlive any node)."""
ENV_STORE_JOB = "TIERCKPT_STORE_JOB"
"""The job's name in that store (its keys live under ``/tierckpt/<job>/``)."""
DEFAULT_TIMEOUT_S = 60.0
"""How long a survivor waits for the launcher's next generation and for the group to form."""


@dataclass(frozen=True)
class HealEnv:
    """This process's place in a healing job: the job start's id, the generation it joined,
    and the bound on one heal's waits."""

    id: str
    gen: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    def key(self, name: str) -> str:
        """A store key of this job start (see the module docstring)."""
        return f"tierckpt/heal/{self.id}/{name}"

    def pg_prefix(self, gen: int | None = None) -> str:
        """The store prefix of generation ``gen``'s process groups (this one's by default)."""
        return f"tierckpt/{self.id}/gen{self.gen if gen is None else gen}/"


def store_url(endpoints: str) -> str:
    """The :data:`ENV_STORE` value for etcd client URLs ``http://h:p,...`` or ``h:p,...``."""
    hosts = [e.strip().removeprefix("http://") for e in endpoints.split(",") if e.strip()]
    return "etcd://" + ",".join(hosts)


def read_store(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The job's etcd store named in the environment, as (client URLs, job), or None when
    the environment names none. ConfigError for a malformed value (it names the variable)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_STORE, "")
    if not raw:
        return None
    job = env.get(ENV_STORE_JOB, "")
    if not raw.startswith("etcd://") or not raw[len("etcd://"):] or not job:
        raise ConfigError(f"{ENV_STORE}={raw!r} {ENV_STORE_JOB}={job!r}: need "
                          "etcd://host:port[,host:port...] and a job name")
    return ",".join(f"http://{h}" for h in raw[len("etcd://"):].split(",") if h), job


def read(environ: Mapping[str, str] | None = None) -> HealEnv | None:
    """The heal launcher's environment, or None when this process was not started by it.
    Raises ConfigError for a malformed value (it names the variable)."""
    env = os.environ if environ is None else environ
    heal_id = env.get(ENV_ID, "")
    if not heal_id:
        return None
    raw_gen, raw_timeout = env.get(ENV_GEN, "0"), env.get(ENV_TIMEOUT, "")
    try:
        gen = int(raw_gen)
        timeout = float(raw_timeout) if raw_timeout else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ConfigError(f"{ENV_GEN}={raw_gen!r} / {ENV_TIMEOUT}={raw_timeout!r}: need an "
                          "integer generation and a number of seconds") from None
    if gen < 0 or not timeout > 0:
        raise ConfigError(f"{ENV_GEN} must be >= 0 and {ENV_TIMEOUT} > 0, got {gen}, "
                          f"{timeout}")
    return HealEnv(heal_id, gen, timeout)
