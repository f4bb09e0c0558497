"""A real one-node Slurm cluster in a temporary directory, started without systemd.

Three daemons, each in the foreground as a child of the test process (so their ids are
ours to end): a private ``munged`` on its own socket and key, ``slurmctld`` and ``slurmd``,
all with their state, spool, logs and pid files under ``root``. Clients reach it through
``SLURM_CONF`` (:attr:`SlurmCluster.env`). The node has 2 CPUs and two partitions on it:

- ``low`` (the default): ``PriorityTier=1 PreemptMode=REQUEUE GraceTime=<grace_s>``;
- ``high``: ``PriorityTier=2 PreemptMode=OFF`` — a job submitted here preempts ``low``'s.

Configuration as measured in ../shared/research/slurm.md (Slurm 22.05, Debian 12). No
accounting daemon: the final state of a job is read with ``scontrol show job``, which keeps
a finished job for ``MinJobAge`` (300 s).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tierckpt._ports import reserve

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel")


def missing_tools() -> list[str]:
    """The Slurm and munge programs this cluster needs that are not installed."""
    return [t for t in (*DAEMONS, *CLIENTS)
            if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    return reserve(n)


def slurm_conf(root: Path, *, host: str, ports: tuple[int, int], grace_s: int,
               kill_wait_s: int) -> str:
    """The slurm.conf of the test cluster (every path under ``root``)."""
    return f"""\
ClusterName=tierckpt
SlurmctldHost={host}
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={kill_wait_s}
MinJobAge=300
JobRequeue=1
MpiDefault=none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={host} CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=low Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
PreemptMode=REQUEUE GraceTime={grace_s} OverSubscribe=NO
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF \
OverSubscribe=NO
"""


class SlurmCluster:
    """A running test cluster; :meth:`stop` (or leaving the ``with``) ends every process it
    started and every job step left on its node. Each client call has a timeout."""

    def __init__(self, root: Path, *, grace_s: int = 20, kill_wait_s: int = 5) -> None:
        self.root = root
        self.grace_s = grace_s
        self.host = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []
        for d in ("state", "spool"):
            (root / d).mkdir(parents=True, exist_ok=True)
        ctld, slurmd = _free_ports(2)
        self.conf.write_text(slurm_conf(root, host=self.host, ports=(ctld, slurmd),
                                        grace_s=grace_s, kill_wait_s=kill_wait_s))
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        """Start munged, slurmctld and slurmd; return once ``sinfo`` shows the node idle.
        Raises RuntimeError with the daemons' logs when it does not come up in time."""
        r = self.root
        self._spawn("munged", [_exe("munged"), "-F", "--force", f"--socket={r}/munge.sock",
                               f"--key-file={r}/munge.key", f"--pid-file={r}/munged.pid",
                               f"--log-file={r}/munged.log", f"--seed-file={r}/munge.seed"])
        self._wait(lambda: (r / "munge.sock").exists(), 10, "munged's socket")
        self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_exe("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(lambda: self.node_state() == "idle", timeout_s, "the node to be idle")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")  # noqa: SIM115  (closed with the proc)
        self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True))
        log.close()

    def _wait(self, ok: object, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"Slurm test cluster: {dead} exited\n{self.logs()}")
            if ok():  # type: ignore[operator]
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm test cluster: no {what} after {timeout_s} s\n{self.logs()}")

    def logs(self, tail: int = 30) -> str:
        """The last lines of every daemon log, for failure messages."""
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.out",
                     "slurmd.out"):
            p = self.root / name
            if p.is_file():
                lines = p.read_text(errors="replace").splitlines()[-tail:]
                out.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(out)

    # --- clients ---------------------------------------------------------------------

    def run(self, *argv: str, timeout_s: float = 30, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """One Slurm client command against this cluster."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                              env={**self.env, **(env or {})})
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: "
                               f"{proc.stdout}{proc.stderr}")
        return proc

    def node_state(self) -> str:
        p = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout_s=10)
        return p.stdout.strip().split("\n")[0].rstrip("*") if p.returncode == 0 else ""

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit ``script``; returns the job id."""
        out = self.run("sbatch", "--parsable", *args, str(script), env=env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once the job is forgotten)."""
        p = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", p.stdout)) if p.returncode == 0 else {}

    def wait_job(self, job_id: int, states: set[str], timeout_s: float) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; returns its record. A requeued
        job's start is pulled forward (``StartTime=now``) to skip its ~2-minute wait."""
        end = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        held_since: float | None = None
        while time.monotonic() < end:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            waiting = info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
            held_since = (held_since or time.monotonic()) if waiting else None
            # Not at once: slurmd refuses a job restarted within the second it revoked the
            # old run's credential ("Job credential revoked"), and the job then FAILS.
            if (held_since is not None and time.monotonic() - held_since > 2
                    and self.node_state() == "idle"):
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now",
                         check=False)
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout_s} s: "
                           f"{info}\n{self.logs(10)}")

    def cancel_all(self, timeout_s: float = 60) -> None:
        """Cancel every job and wait until the node is idle again."""
        self.run("scancel", "--full", "-u", "root", check=False)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            q = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if not q and self.node_state() == "idle":
                return
            time.sleep(0.5)

    # --- teardown --------------------------------------------------------------------

    def _our_steps(self) -> list[int]:
        """Pids of processes (slurmstepd and the job's own) whose environment names this
        cluster's configuration: what slurmd started, wherever it was re-parented."""
        mine = f"SLURM_CONF={self.conf}".encode()
        daemons = {p.pid for p in self._procs}
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in daemons or int(d.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if mine in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
        return pids

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons (SIGTERM, then SIGKILL), and kill whatever
        step process of this cluster is left. Idempotent."""
        if self._procs and all(p.poll() is None for p in self._procs):
            with contextlib.suppress(Exception):
                self.cancel_all(timeout_s=30)
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for pid in self._our_steps():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._procs.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
