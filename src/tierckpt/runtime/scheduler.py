"""Which scheduler runs this process, read from its environment, and the notice it gives
before a kill. Torch-free.

:func:`detect` is pure (an environment in, a :class:`Scheduler` or None out):

- **Slurm**: ``SLURM_JOB_ID`` is set (every process of a job has it: the batch shell, srun
  tasks, and the torchrun workers they start). ``SLURM_RESTART_COUNT`` counts the job's
  requeues (Slurm sets it only from the first requeue on: absent means 0);
  ``SLURM_JOB_PARTITION`` and ``SLURMD_NODENAME`` say where it runs.
- **Kubernetes**: ``KUBERNETES_SERVICE_HOST`` is set (the kubelet puts it in every
  container). The rest comes from the downward API, as the manifests of
  ``tierckpt launch k8s`` set it: :data:`JOB_ID_ENV` (the JobSet's name),
  :data:`RESTARTS_ENV` (the JobSet's restart attempt) and :data:`POD_ENV` (else
  ``HOSTNAME``, which is the pod's name unless the pod sets another).

:func:`notice_grace` says how long the job has from a notice to the kill, best source
first; None when nothing says (the caller then takes its default):

1. :data:`GRACE_ENV` (``TIERCKPT_GRACE_S``), seconds for every notice: a launcher that
   knows the grace sets it (``tierckpt launch k8s`` writes torchrun's shutdown timeout,
   ``terminationGracePeriodSeconds`` less the teardown: the window the workers get);
2. under Slurm, read once with a short timeout (``scontrol``, at most ``timeout_s``
   in all; a failure or timeout only loses that source): the ``#SBATCH --signal`` of the
   job's batch script gives its signal's lead (the time limit is that far away; a
   ``--signal`` given on the sbatch command line is not seen), and the partition's
   ``GraceTime`` (where its ``PreemptMode`` is not ``OFF``) gives SIGTERM's (a preemption
   kills that long after its SIGTERM). A QOS's ``GraceTime`` is not read.

Every rank of a job reads the same sources, so every rank gets the same grace.

:func:`slurm_interruption` says what a notice under Slurm was (pure): *announced* — the job
was preempted (``PreemptTime`` is set) or the ``--signal`` lead came (USR1) — or a user's
``scancel`` (SIGTERM while neither preempted nor at the time limit), or no notice at all.
The launchers' verdict (:mod:`tierckpt.launch.outcome`) and the job's own requeue after its
emergency save (:mod:`tierckpt.preempt.requeue`) both read it, so they never disagree.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from typing import Any

from tierckpt.errors import ConfigError

SLURM, KUBERNETES = "slurm", "kubernetes"

GRACE_ENV = "TIERCKPT_GRACE_S"
"""Seconds from any notice to the kill, when a launcher knows them (overrides the
scheduler's own sources; ``Preemption(grace_s=...)`` overrides it)."""
JOB_ID_ENV = "TIERCKPT_JOB_ID"
"""Kubernetes: the job's name (``tierckpt launch k8s``: the JobSet's, from its label)."""
RESTARTS_ENV = "RESTART_ATTEMPT"
"""Kubernetes: how many times the JobSet restarted (its ``restart-attempt`` annotation)."""
POD_ENV = "POD_NAME"
"""Kubernetes: the pod's name (downward API ``metadata.name``)."""

MAX_REQUEUES_ENV = "TIERCKPT_MAX_REQUEUES"
"""Slurm: requeue the job after an emergency save at most this many times (``Restarts`` in
``scontrol show job`` counts them); unset: no limit of ours (Slurm's ``MaxBatchRequeue``
still applies). ``tierckpt launch slurm --max-requeues`` exports it."""

NOTICES = ("usr1", "term")
"""The notice kinds a Slurm job tells apart: the ``--signal`` lead's USR1, a SIGTERM."""

SLURM_DEFAULT_LEAD_S = 60.0
"""Slurm's lead when ``--signal`` names no ``@seconds``."""

_SIGNAL_OPT = re.compile(r"--signal[=\s]+(?:[RB]+:)?([A-Za-z0-9]+)(?:@(\d+))?")


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """The scheduler this process runs under. ``name``: :data:`SLURM` or
    :data:`KUBERNETES`; ``job_id``: the scheduler's id of the job (None: not known);
    ``restarts``: how many times the scheduler ran the job again before this run (Slurm's
    requeues, the JobSet's restarts; None: not known), so 0 is the first incarnation the
    scheduler started; ``partition`` (Slurm), ``node`` (Slurm), ``pod`` (Kubernetes)."""

    name: str
    job_id: str | None = None
    restarts: int | None = None
    partition: str | None = None
    node: str | None = None
    pod: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The fields that are known, for an event record (``process_start.scheduler``)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Grace:
    """Seconds from a notice to the expected kill. ``by_signal``: per signal number (the
    ``--signal`` lead for its signal, GraceTime for SIGTERM); ``seconds``: for any other
    notice (None: not known); ``source``: where each came from, for a log line."""

    seconds: float | None = None
    by_signal: tuple[tuple[int, float], ...] = ()
    source: str = ""

    def for_signal(self, signum: int) -> float | None:
        """The grace after signal ``signum``: its own, else :attr:`seconds`."""
        return dict(self.by_signal).get(int(signum), self.seconds)


@dataclasses.dataclass(frozen=True)
class SlurmFacts:
    """What ``scontrol show job`` says of a job: its state and reason, whether it was
    preempted (``PreemptTime`` set), its requeue count (``Restarts``) and whether it may be
    requeued (``Requeue=1``: ``--requeue``, or the cluster's ``JobRequeue=1``)."""

    job_id: str
    state: str
    reason: str
    preempted: bool
    restarts: int
    requeue: bool


@dataclasses.dataclass(frozen=True)
class Interruption:
    """What a notice under Slurm was (:func:`slurm_interruption`). ``announced``: Slurm
    announced the end (preemption, or the ``--signal`` lead before the time limit);
    ``cancelled``: a user's ``scancel``; neither: no notice (the job finished or failed).
    ``what``: a few words for a log line."""

    announced: bool
    cancelled: bool
    what: str


def notice_words(notices: Iterable[str]) -> set[str]:
    """``notices`` as a set of :data:`NOTICES` words; ConfigError naming any other."""
    got = set(notices)
    unknown = got - set(NOTICES)
    if unknown:
        raise ConfigError(f"unknown notice {sorted(unknown)}; a launcher reports "
                          f"{', '.join(NOTICES)}")
    return got


def slurm_interruption(notices: Iterable[str], facts: SlurmFacts) -> Interruption:
    """Classify the notices a Slurm job got (words of :data:`NOTICES`) against ``facts``:
    a SIGTERM while the job is neither preempted nor at its time limit is a ``scancel``
    (never run again); otherwise a preemption or the lead's USR1 is announced. Pure.
    ConfigError for a word that is not a notice kind."""
    got = notice_words(notices)
    if "term" in got and not facts.preempted and facts.reason != "TimeLimit":
        return Interruption(False, True, "cancelled by its user (SIGTERM, not preempted, "
                            "not at the time limit)")
    if facts.preempted:
        return Interruption(True, False, "preempted")
    if "usr1" in got:
        return Interruption(True, False, "time limit ahead (--signal)")
    return Interruption(False, False, "no notice")


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol -o show job`` (or partition) output as ``{Key: value}``."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def read_slurm_job(job_id: str, *, timeout_s: float = 15.0) -> SlurmFacts:
    """Ask ``scontrol`` about ``job_id`` (at most ``timeout_s``). ConfigError naming what to
    fix when it cannot."""
    try:
        p = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                           text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"cannot ask scontrol about job {job_id}: {e}; run this inside the "
                          "Slurm job, with the Slurm client tools on PATH") from None
    if p.returncode != 0:
        raise ConfigError(f"scontrol show job {job_id} failed: {p.stderr.strip()}")
    f = parse_scontrol(p.stdout)
    return SlurmFacts(job_id=job_id, state=f.get("JobState", ""), reason=f.get("Reason", ""),
                      preempted=f.get("PreemptTime", "None") not in ("None", "Unknown", ""),
                      restarts=int(f.get("Restarts", "0") or 0),
                      requeue=f.get("Requeue", "0") == "1")


def max_requeues(env: Mapping[str, str]) -> int | None:
    """:data:`MAX_REQUEUES_ENV` as a count; None when unset. ConfigError when malformed."""
    raw = env.get(MAX_REQUEUES_ENV, "")
    if not raw:
        return None
    n = _count(raw)
    if n is None:
        raise ConfigError(f"{MAX_REQUEUES_ENV}={raw!r}: give a whole number >= 0, or unset it")
    return n


def detect(env: Mapping[str, str]) -> Scheduler | None:
    """The scheduler that ``env`` (a process's environment) belongs to; None when neither
    Slurm nor Kubernetes. Malformed counts read as None (never an error: a job must start)."""
    if env.get("SLURM_JOB_ID"):
        return Scheduler(SLURM, job_id=env["SLURM_JOB_ID"],
                         restarts=_count(env.get("SLURM_RESTART_COUNT", "0")),
                         partition=env.get("SLURM_JOB_PARTITION") or None,
                         node=env.get("SLURMD_NODENAME") or None)
    if env.get("KUBERNETES_SERVICE_HOST"):
        return Scheduler(KUBERNETES, job_id=env.get(JOB_ID_ENV) or None,
                         restarts=_count(env.get(RESTARTS_ENV, "0") or "0"),
                         pod=env.get(POD_ENV) or env.get("HOSTNAME") or None)
    return None


def notice_grace(env: Mapping[str, str], *, timeout_s: float = 1.0) -> Grace | None:
    """The grace this job's launcher or scheduler gives a notice (the sources in the module
    docstring, best first); None when none says. Blocks at most ``timeout_s`` (only under
    Slurm, for ``scontrol``). ConfigError when :data:`GRACE_ENV` is not a number of seconds."""
    raw = env.get(GRACE_ENV)
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            raise ConfigError(f"{GRACE_ENV}={raw!r}: give the seconds from a notice to the "
                              "kill as a number > 0, or unset it")
        return Grace(seconds=seconds, source=f"{GRACE_ENV}={raw}")
    found = detect(env)
    if found is not None and found.name == SLURM and found.job_id:
        return slurm_grace(found.job_id, found.partition, timeout_s=timeout_s)
    return None


def slurm_grace(job_id: str, partition: str | None, *, timeout_s: float = 1.0
                ) -> Grace | None:
    """Slurm's notices for ``job_id``: the batch script's ``--signal`` lead for its signal,
    ``partition``'s ``GraceTime`` for SIGTERM. Two ``scontrol`` calls, at most
    ``timeout_s`` in all; None when neither answers."""
    deadline = time.monotonic() + timeout_s
    by_signal: dict[int, float] = {}
    said: list[str] = []
    script = _scontrol(("write", "batch_script", job_id, "-"), deadline)
    lead = sbatch_signal(script) if script else None
    if lead is not None:
        by_signal[lead[0]] = lead[1]
        said.append(f"--signal {signal.Signals(lead[0]).name}@{lead[1]:g} "
                    f"(job {job_id}'s batch script)")
    fields = (parse_scontrol(_scontrol(("-o", "show", "partition", partition), deadline) or "")
              if partition else {})
    grace_time = _count(fields.get("GraceTime", ""))
    if fields.get("PreemptMode", "OFF").upper() != "OFF" and grace_time:
        term = int(signal.SIGTERM)
        by_signal[term] = min(by_signal.get(term, math.inf), float(grace_time))
        said.append(f"SIGTERM {grace_time} s (partition {partition}'s GraceTime)")
    if not by_signal:
        return None
    return Grace(seconds=by_signal.get(int(signal.SIGTERM)),
                 by_signal=tuple(sorted(by_signal.items())), source="Slurm: " + "; ".join(said))


def sbatch_signal(text: str) -> tuple[int, float] | None:
    """The ``#SBATCH --signal=[R|B:]SIG[@SECONDS]`` of a batch script: (signal number, lead
    in seconds; Slurm's default :data:`SLURM_DEFAULT_LEAD_S` without ``@``); None when the
    script has none or names no known signal."""
    opts = " ".join(line[len("#SBATCH"):] for line in text.splitlines()
                    if line.startswith("#SBATCH"))
    m = _SIGNAL_OPT.search(opts)
    if m is None:
        return None
    name = m.group(1).upper()
    try:
        num = (signal.Signals(int(name)) if name.isdigit()
               else signal.Signals[name if name.startswith("SIG") else "SIG" + name])
    except (KeyError, ValueError):
        return None
    return int(num), float(m.group(2)) if m.group(2) else SLURM_DEFAULT_LEAD_S


def _scontrol(args: tuple[str, ...], deadline: float) -> str | None:
    """``scontrol ARGS``'s output, or None (missing, failed, or past ``deadline``)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    try:
        p = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=left)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def _count(raw: str) -> int | None:
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if n >= 0 else None
