"""Launch the training command under torchrun on loopback, one agent per simulated node.

The contract with the training command (``examples/train.py`` follows it): it accepts
``--tier1 DIR --losses FILE --steps N`` (and ``--tier2 URL`` for the tier-2 drill,
``--tier0 auto|DIR`` for a chaos drill with tier 0), uses
``tierckpt.init_distributed`` / ``CheckpointManager`` / ``StepWatchdog`` so its events land
in ``<tier1>/events.jsonl``, and its rank 0 appends one JSON line per completed step to the
losses file (``step``, ``loss``, optionally ``loss_hex``, ``attempt``, ``world_size``,
``epoch``, ``position``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierckpt._ports import free_port
from tierckpt.errors import ConfigError

__all__ = ["Job", "JobSpec", "agent_argv", "free_port", "heal_argv", "training_argv"]


def _is_python(arg: str) -> bool:
    name = os.path.basename(arg)
    return name.startswith("python") or arg == sys.executable


def agent_argv(command: Sequence[str], *, nproc: int, nnodes: int, node_rank: int,
               max_restarts: int, port: int, run_id: str) -> list[str]:
    """The torchrun agent command line for one node running ``command``.

    ``python script.py ...`` and ``python -m module ...`` run under the agent's interpreter;
    anything else runs with ``--no-python``. One node uses ``--standalone``; several use a
    c10d rendezvous on ``127.0.0.1:port`` (restarts then re-rendezvous every node).
    """
    if not command:
        raise ConfigError("give the training command after --, e.g. "
                          "tierckpt drill -- python examples/train.py")
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ConfigError(f"--nproc and --nnodes must be >= 1 (got {nproc}, {nnodes})")
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
    if nnodes == 1:
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]
    cmd = list(command)
    if _is_python(cmd[0]):
        cmd = cmd[1:]
        if not cmd:
            raise ConfigError("the training command names python but no script or -m module")
        return argv + cmd  # "script.py ..." or "-m module ...": torchrun takes both
    return [*argv, "--no-python", *cmd]


def heal_argv(command: Sequence[str], *, nproc: int, max_restarts: int,
              spares: int = 2) -> list[str]:
    """The ``tierckpt run`` command line (our heal launcher, one node) running ``command``
    with ``nproc`` ranks, ``spares`` pre-warmed spares, and at most ``max_restarts`` full
    restarts (a heal that must fail falls back to one)."""
    if not command:
        raise ConfigError("give the training command after --, e.g. "
                          "tierckpt drill --heal -- python examples/train.py")
    return [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
            "sys.argv[0] = 'tierckpt'; main()", "run", "--nproc-per-node", str(nproc),
            "--spares", str(spares), "--max-restarts", str(max_restarts), "--", *command]


def training_argv(command: Sequence[str], *, tier1: Path, losses: Path, steps: int,
                  tier2: str | None = None, tier0: str | None = None) -> list[str]:
    """``command`` plus the flags the drill controls (later flags win in argparse)."""
    out = [*command, "--tier1", str(tier1), "--losses", str(losses), "--steps", str(steps)]
    if tier2 is not None:
        out += ["--tier2", tier2]
    if tier0 is not None:
        out += ["--tier0", tier0]
    return out


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training job: ``nnodes`` agents of ``nproc`` ranks, node i on ``roots[i]`` (and,
    with ``tier0``, ``--tier0 tier0[i]``); with ``heal``, one node under ``tierckpt run``
    (:func:`heal_argv`) instead of torchrun."""

    name: str
    command: tuple[str, ...]
    roots: tuple[Path, ...]
    losses: Path
    steps: int
    nproc: int
    max_restarts: int = 0
    tier2: str | None = None
    tier0: tuple[str, ...] | None = None
    heal: bool = False

    def __post_init__(self) -> None:
        if self.heal and self.nnodes != 1:
            raise ConfigError(f"a heal job runs on one node, got {self.nnodes} roots")

    @property
    def nnodes(self) -> int:
        return len(self.roots)


class Job:
    """The running agents of a :class:`JobSpec`; a context manager that kills what is left.

    Agent output goes to ``<losses dir>/<name>-node<i>.log``.
    """

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started_at = 0.0
        self.logs = [spec.losses.parent / f"{spec.name}-node{i}.log"
                     for i in range(spec.nnodes)]

    def start(self) -> Job:
        spec = self.spec
        port, run_id = free_port(), f"drill-{spec.name}-{os.getpid()}"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        self.started_at = time.time()
        for i, root in enumerate(spec.roots):
            train = training_argv(spec.command, tier1=root, losses=spec.losses,
                                  steps=spec.steps, tier2=spec.tier2,
                                  tier0=spec.tier0[i] if spec.tier0 else None)
            argv = heal_argv(train, nproc=spec.nproc, max_restarts=spec.max_restarts) \
                if spec.heal else agent_argv(train, nproc=spec.nproc, nnodes=spec.nnodes,
                                             node_rank=i, max_restarts=spec.max_restarts,
                                             port=port, run_id=run_id)
            with open(self.logs[i], "ab") as log:
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                                   stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True))
        return self

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self, timeout_s: float) -> int:
        """Wait for every agent; the first non-zero exit status, else 0. On timeout the
        agents are killed and 124 is returned."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                return 124
        return next((c for c in codes if c), 0)

    def tail(self, chars: int = 3000) -> str:
        """The end of every agent's log, for error messages."""
        out = []
        for path in self.logs:
            with contextlib.suppress(OSError):
                out.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def kill(self) -> None:
        """Stop every agent still running: SIGTERM (the agent stops its workers), then
        SIGKILL to the agent's process group after 10 s; idempotent."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            p.terminate()
        for p in live:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def __enter__(self) -> Job:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
