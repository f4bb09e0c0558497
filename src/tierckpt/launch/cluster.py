"""``tierckpt doctor --cluster``: does this job's launch let a notice end in a committed
emergency save? :func:`gather` reads the facts (environment, the parent torchrun's command
line, ``scontrol``, a script or manifest); :func:`checks` judges them (pure) against the
measured emergency-save time, each failed check saying what to fix.

Where the facts come from, first found wins:

- torchrun's flags: ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (set by torchrun for its workers),
  an ancestor process running torchrun (``/proc/PID/cmdline``), else the script given or
  the Slurm job's batch script (``scontrol write batch_script``);
- Slurm: ``scontrol show job $SLURM_JOB_ID`` (``Requeue``), the batch script's
  ``#SBATCH --signal`` (or the script given), ``scontrol show partition`` (``GraceTime``
  and ``PreemptMode``);
- Kubernetes: ``terminationGracePeriodSeconds`` in the manifest given.

A job whose nodes run ``tierckpt run --nnodes`` with the job's store in etcd (``tierckpt
launch --etcd``, docs/heal.md) is judged on that instead of torchrun: the supervisor passes
the notice on, a spare node waits to take a lost node's ranks, and the job's etcd answers
(asked from here: ``GET /health`` on every member, 3 s each).

The requeue path a Slurm job needs (docs/schedulers.md): ``#SBATCH --requeue``, a loop that
follows the contract (``should_save``/``should_stop``; not visible here), and notices that
reach the workers. The job then requeues itself after its emergency save
(:mod:`tierckpt.preempt.requeue`), so a script needs no ``scontrol requeue`` of its own;
but a ``--signal=B:...`` goes to the batch shell only, which must pass it on (a ``trap``),
or the time limit's notice never reaches torchrun.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tierckpt import _proc
from tierckpt.errors import ConfigError
from tierckpt.launch.timing import SaveTime
from tierckpt.runtime.nodespec import (
    FORWARDED,
    member_health,
    member_space,
    parse_endpoint,
    parse_nnodes,
)
from tierckpt.runtime.scheduler import parse_scontrol, sbatch_signal

TORCHRUN_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
TORCHRUN_DEFAULT_SHUTDOWN_S = 30.0
_TORCHRUN = re.compile(r"(torchrun|torch\.distributed\.run)\b")
_HEAL = re.compile(r"\btierckpt run\b")
_ETCD_PROBE_S = 3.0
_BATCH_ONLY = re.compile(r"--signal[=\s]+R?BR?:")


@dataclasses.dataclass(frozen=True)
class Facts:
    """What :func:`gather` found (None: not found). ``*_from`` say where."""

    scheduler: str | None = None
    torchrun_from: str | None = None
    signals: tuple[str, ...] | None = None
    shutdown_s: float | None = None
    slurm_signal: str | None = None
    slurm_lead_s: float | None = None
    slurm_requeue: bool | None = None
    requeue_from: str | None = None
    slurm_batch_only: bool | None = None
    """``--signal=B:``: the lead's signal goes to the batch shell only."""
    slurm_forwards: bool | None = None
    """The batch script traps the lead's signal (to pass it to the step)."""
    grace_s: float | None = None
    grace_from: str | None = None
    heal_from: str | None = None
    """Where a ``tierckpt run`` (instead of torchrun) was found."""
    heal_nnodes: str | None = None
    heal_etcd: str | None = None
    etcd_answers: bool | None = None
    etcd_detail: str = ""


@dataclasses.dataclass(frozen=True)
class Check:
    """One verdict: ``ok`` True/False, or None when it could not be checked."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""


def _signal_name(text: str) -> str:
    t = text.strip().upper()
    if t.isdigit():
        try:
            return signal.Signals(int(t)).name
        except ValueError:
            return t
    return t if t.startswith("SIG") else "SIG" + t


def parse_torchrun(text: str) -> tuple[tuple[str, ...], float] | None:
    """torchrun's handled signals and shutdown timeout from a command line or script that
    runs it (defaults where a flag is absent; the environment's
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is not seen here); None when no torchrun is found."""
    if not _TORCHRUN.search(text):
        return None
    sig = re.search(r"--signals[-_]to[-_]handle[=\s]+[\"']?([A-Za-z0-9_,]+)", text)
    shut = re.search(r"--shutdown[-_]timeout[=\s]+[\"']?(\d+(\.\d+)?)", text)
    sigs = (tuple(_signal_name(s) for s in sig.group(1).split(",") if s) if sig
            else TORCHRUN_DEFAULT_SIGNALS)
    return sigs, float(shut.group(1)) if shut else TORCHRUN_DEFAULT_SHUTDOWN_S


def parse_heal(text: str) -> tuple[str | None, str | None] | None:
    """``--nnodes`` and ``--rdzv-endpoint`` of a ``tierckpt run`` in a command line or
    script (None each when absent; comment lines are not read); None when no ``tierckpt
    run`` is found."""
    text = "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#"))
    if not _HEAL.search(text):
        return None
    nnodes = re.search(r"--nnodes[=\s]+[\"']?([0-9:]+)", text)
    etcd = re.search(r"--rdzv[-_]endpoint[=\s]+[\"']?([^\s\"']+)", text)
    return (nnodes.group(1) if nnodes else None), (etcd.group(1) if etcd else None)


def probe_etcd(endpoint: str) -> tuple[bool, str]:
    """Whether a majority of the etcd members in ``endpoint`` (``etcd://h:p[,h:p]``)
    answer ``GET /health`` as healthy, and a line saying what each answered."""
    try:
        urls = parse_endpoint(endpoint).split(",")
    except ConfigError as e:
        return False, str(e)
    said = []
    for url in urls:
        why = member_health(url, _ETCD_PROBE_S)
        said.append((why is None, f"{url}: {why or 'healthy'}"))
    up = sum(ok for ok, _ in said)
    line = f"{up} of {len(urls)} member(s) healthy: " + "; ".join(x for _, x in said)
    size, alarms = None, list[str]()  # from the first member that answers (a member with
    for url in urls:                   # an alarm raised answers /health 503: unhealthy)
        size, alarms = member_space(url, _ETCD_PROBE_S)
        if size is not None:
            break
    if size is not None:
        line += f"; database {size / 2**20:.1f} MiB"
    if alarms:  # every write refused, or a member's data damaged: the job cannot heal
        return False, f"{line}; " + "; ".join(_ALARMS.get(a, f"etcd raised {a}")
                                             for a in alarms)
    return up > len(urls) // 2, line


def wait_etcd(endpoint: str, *, within_s: float, every_s: float = 2.0,
              say: Callable[[str], None] = lambda _: None) -> tuple[bool, str]:
    """:func:`probe_etcd` until it answers True or ``within_s`` seconds passed: the last
    answer; ``say`` hears what the members answer every 30 s. ConfigError for a bad
    ``endpoint``."""
    parse_endpoint(endpoint, flag="--etcd")
    deadline = time.monotonic() + within_s
    next_say = time.monotonic() + 30.0
    while True:
        ok, line = probe_etcd(endpoint)
        if ok or time.monotonic() >= deadline:
            return ok, line
        if time.monotonic() >= next_say:
            say(f"waiting for the job's etcd: {line}")
            next_say += 30.0
        time.sleep(min(every_s, max(0.0, deadline - time.monotonic())))


_ALARMS = {  # etcd's alarm -> what it means and what to do
    "NOSPACE": "etcd raised NOSPACE: its database is full (quota, 2 GiB by default): compact "
               "and defragment it (etcdctl compact, etcdctl defrag, etcdctl alarm disarm) and "
               "run it with --auto-compaction-mode=periodic --auto-compaction-retention=5m",
    "CORRUPT": "etcd raised CORRUPT: a member's data differs from the others' (etcd's "
               "corruption check): remove that member and add it back empty (etcdctl member "
               "remove, etcdctl member add), or restore the cluster from a snapshot",
}


def forwards_signal(text: str, name: str) -> bool:
    """Whether a batch script traps signal ``name`` (``SIGUSR1``): a ``trap`` line naming
    it, as a script that passes the lead's signal to its step has."""
    short = name.removeprefix("SIG")
    return any(line.lstrip().startswith("trap") and re.search(rf"\b(SIG)?{short}\b", line)
               for line in text.splitlines())


def parse_sbatch(text: str) -> tuple[str | None, float | None, bool | None]:
    """``#SBATCH --signal`` (signal name, lead in seconds: 60 when not given) and
    ``--requeue``/``--no-requeue`` (None: neither) from a batch script."""
    opts = " ".join(line[len("#SBATCH"):] for line in text.splitlines()
                    if line.startswith("#SBATCH"))
    found = sbatch_signal(text)
    name, lead = (signal.Signals(found[0]).name, found[1]) if found else (None, None)
    requeue = (False if "--no-requeue" in opts else True if "--requeue" in opts else None)
    return name, lead, requeue


def _ancestor_torchrun(pid: int) -> tuple[str, str] | None:
    """(where, command line) of the nearest ancestor running torchrun or ``tierckpt
    run``."""
    for _ in range(16):
        up = _proc.parent(pid)
        cmd = _proc.cmdline(up) if up is not None else None
        if up is None or cmd is None:
            return None
        pid = up
        if _TORCHRUN.search(cmd) or _HEAL.search(cmd):
            what = "torchrun" if _TORCHRUN.search(cmd) else "tierckpt run"
            return f"the parent {what} (pid {pid})", cmd
        if pid <= 1:
            return None
    return None


def _scontrol(*args: str) -> str | None:
    try:
        p = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def gather(env: Mapping[str, str] | None = None, *, script: Path | None = None) -> Facts:
    """Read the facts of the job this runs in (``env``: the environment) and of
    ``script`` (an sbatch script or a Kubernetes manifest), if given."""
    env = os.environ if env is None else env
    text = script.read_text() if script is not None else None
    job = env.get("SLURM_JOB_ID")
    batch = _scontrol("write", "batch_script", job, "-") if job else None
    f: dict[str, object] = {}
    f["scheduler"] = ("slurm" if job or (text and "#SBATCH" in text) else "kubernetes"
                      if env.get("KUBERNETES_SERVICE_HOST") or (text and "kind:" in text)
                      else None)
    found = _ancestor_torchrun(os.getpid())
    sources = [(where, txt) for where, txt in (
        ("TORCHELASTIC_SIGNALS_TO_HANDLE", f"torchrun --signals-to-handle "
         f"{env['TORCHELASTIC_SIGNALS_TO_HANDLE']}" if "TORCHELASTIC_SIGNALS_TO_HANDLE" in env
         else None), found or (None, None), (str(script), text),
        (f"job {job}'s batch script", batch)) if where and txt]
    heal = [(where, h) for where, txt in sources if (h := parse_heal(txt)) is not None]
    if heal:
        f["heal_from"], (f["heal_nnodes"], f["heal_etcd"]) = heal[0]
        if f["heal_etcd"]:
            f["etcd_answers"], f["etcd_detail"] = probe_etcd(str(f["heal_etcd"]))
    parsed = [(where, tr, "--shutdown" in txt) for where, txt in sources
              if (tr := parse_torchrun(txt)) is not None]
    if parsed:
        f["torchrun_from"], f["signals"] = parsed[0][0], parsed[0][1][0]
        # the environment names the signals only: take the timeout where a flag gives it
        f["shutdown_s"] = next((tr[1] for _, tr, has in parsed if has), parsed[0][1][1])
    for where, txt in ((str(script), text), (f"job {job}'s batch script", batch)):
        if txt and "#SBATCH" in txt:
            name, lead, requeue = parse_sbatch(txt)
            f.setdefault("slurm_signal", name)
            f.setdefault("slurm_lead_s", lead)
            if name is not None and "slurm_batch_only" not in f:
                opts = "\n".join(x for x in txt.splitlines() if x.startswith("#SBATCH"))
                f["slurm_batch_only"] = bool(_BATCH_ONLY.search(opts))
                f["slurm_forwards"] = forwards_signal(txt, name)
            if "slurm_requeue" not in f:  # neither flag: the cluster's default, not the job's
                f["slurm_requeue"] = bool(requeue)
                f["requeue_from"] = where if requeue is not None else (
                    f"{where}: neither --requeue nor --no-requeue")
    if job and (out := _scontrol("-o", "show", "job", job)):
        info = parse_scontrol(out)
        f["slurm_requeue"], f["requeue_from"] = info.get("Requeue") == "1", f"job {job}"
        part = info.get("Partition", "")
        if part and (pout := _scontrol("-o", "show", "partition", part)):
            pinfo = parse_scontrol(pout)
            if pinfo.get("PreemptMode", "OFF") != "OFF":
                f["grace_s"] = float(pinfo.get("GraceTime", "0") or 0)
                f["grace_from"] = f"partition {part}'s GraceTime"
    if text and (m := re.search(r"terminationGracePeriodSeconds:\s*(\d+)", text)):
        f["grace_s"], f["grace_from"] = float(m.group(1)), f"{script}'s pod spec"
    return Facts(**f)  # type: ignore[arg-type]


def checks(f: Facts, save: SaveTime | None) -> list[Check]:
    """Judge ``f`` against the emergency-save time ``save`` (None: not measured)."""
    need = save.seconds if save else None
    need_txt = (f"the measured emergency save ({need:.1f} s: {save.source})" if save
                else "the emergency save (not measured yet: run once with this --tier1)")
    out = _heal_checks(f) if f.heal_from else _torchrun_checks(f, need, need_txt)
    if f.scheduler == "slurm":
        out += _slurm_checks(f, need, need_txt)
    if f.grace_s is not None:
        ok4 = None if need is None else f.grace_s >= need
        knob = ("the GraceTime of the partition or QOS" if f.scheduler == "slurm"
                else "terminationGracePeriodSeconds")
        out.append(Check("the grace period covers the save", ok4,
                         f"{f.grace_s:g} s ({f.grace_from}) vs {need_txt}",
                         "" if ok4 is not False else f"ask for a grace of at least "
                         f"{need:.0f} s ({knob})"))
    return out


def _torchrun_checks(f: Facts, need: float | None, need_txt: str) -> list[Check]:
    """Does torchrun forward the notice, and wait long enough for the save?"""
    if f.signals is None:
        return [Check("torchrun forwards the notice", None, "no torchrun found (not "
                      "under torchrun, and no script given)", "run inside the job, or "
                      "pass --script JOB.sbatch / MANIFEST.yaml")]
    notice = f.slurm_signal or "SIGTERM"
    ok = notice in f.signals
    ok2 = None if need is None or f.shutdown_s is None else f.shutdown_s >= need
    return [Check("torchrun forwards the notice", ok,
                  f"{notice} {'is' if ok else 'is not'} in --signals-to-handle "
                  f"{','.join(f.signals)} ({f.torchrun_from})",
                  "" if ok else f"add {notice} to torchrun's --signals-to-handle, e.g. "
                  f"--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,{notice}"),
            Check("torchrun waits for the save", ok2,
                  f"--shutdown-timeout {f.shutdown_s:g} s vs {need_txt}",
                  "" if ok2 is not False else f"raise torchrun's --shutdown-timeout "
                  f"to at least {need:.0f} s")]


def _heal_checks(f: Facts) -> list[Check]:
    """Does ``tierckpt run`` pass the notice on, does a spare node wait, does etcd
    answer?"""
    notice = f.slurm_signal or "SIGTERM"
    ok = notice in FORWARDED
    out = [Check("tierckpt run forwards the notice", ok,
                 f"{notice} {'is' if ok else 'is not'} one of {','.join(FORWARDED)} "
                 f"({f.heal_from})",
                 "" if ok else "send the notice as SIGUSR1 or SIGTERM (#SBATCH "
                 "--signal=B:USR1@LEAD; tierckpt launch slurm writes it)")]
    try:
        lo, hi = parse_nnodes(f.heal_nnodes or "")
        spare, found = hi > lo, f"--nnodes {f.heal_nnodes}: {hi - lo} spare node(s)"
    except ConfigError:
        spare, found = False, f"--nnodes {f.heal_nnodes or '(none)'}: one node, no spare"
    out.append(Check("a spare node waits to take a lost node's ranks", spare, found,
                     "" if spare else "add a spare node (tierckpt launch --spares 1, i.e. "
                     "--nnodes MIN:MIN+1): without one a lost node restarts every node"))
    if f.heal_etcd is None:
        out.append(Check("the job's etcd answers", False, "no --rdzv-endpoint",
                         "give the job's etcd: tierckpt launch --etcd etcd://host:port"))
    else:
        out.append(Check("the job's etcd answers", f.etcd_answers,
                         f"{f.heal_etcd}: {f.etcd_detail}",
                         "" if f.etcd_answers else "start the job's etcd (docs/heal.md) "
                         "or correct --etcd; run doctor where the nodes run: they must "
                         "reach it"))
    return out


def _slurm_checks(f: Facts, need: float | None, need_txt: str) -> list[Check]:
    """Does Slurm warn early enough, does its signal reach torchrun, does it requeue?"""
    out: list[Check] = []
    if f.slurm_lead_s is None:
        out.append(Check("Slurm warns before the time limit", False, "no --signal: the "
                         "job gets no notice before its time limit",
                         "add #SBATCH --signal=B:USR1@LEAD (tierckpt launch slurm "
                         "computes LEAD)"))
    else:
        ok3 = None if need is None else f.slurm_lead_s >= need
        out.append(Check("Slurm warns before the time limit", ok3,
                         f"--signal {f.slurm_signal}@{f.slurm_lead_s:g} s vs {need_txt}",
                         "" if ok3 is not False else f"raise the --signal lead to at "
                         f"least {need:.0f} s"))
    if f.slurm_batch_only:
        ok5, sig = bool(f.slurm_forwards), (f.slurm_signal or "").removeprefix("SIG")
        out.append(Check(
            "the lead's signal reaches torchrun", ok5,
            f"--signal=B:{sig} goes to the batch shell only; the script "
            f"{'traps' if ok5 else 'does not trap'} it",
            "" if ok5 else f"drop B: (#SBATCH --signal={sig}@LEAD signals "
            "the job's steps, and srun passes it to torchrun), or trap it in the script "
            "and pass it to srun (tierckpt launch slurm writes such a script)"))
    state = {True: "set", False: "not set", None: "unknown"}[f.slurm_requeue]
    where = f" ({f.requeue_from})" if f.requeue_from else ""
    out.append(Check(
        "Slurm requeues the job", f.slurm_requeue,
        f"--requeue {state}{where}" + (": after an announced notice whose emergency "
                                       "save committed, the job requeues itself (rank 0 "
                                       "runs scontrol requeue)" if f.slurm_requeue
                                       else ""),
        "" if f.slurm_requeue else "submit with #SBATCH --requeue (and the cluster's "
        "JobRequeue=1): after its emergency save the job asks Slurm to requeue it, "
        "which Slurm refuses without it; the loop must call should_save and "
        "should_stop (docs/preemption.md)"))
    return out
