"""``tierckpt launch slurm``: the sbatch script that runs a training command so that every
interruption ends the right way (see :mod:`tierckpt.launch.outcome`). Pure: a value in, the
script's text out.

What the script does, in order:

1. asks Slurm for ``--requeue``, ``--open-mode=append`` (one log across requeues),
   ``--signal=B:USR1@LEAD`` (USR1 to the batch shell LEAD seconds before the time limit)
   and, when given, GPUs, CPUs and memory per node; its header holds the command line that
   wrote it;
2. reads the tier paths from the environment (``TIERCKPT_TIER1``, required;
   ``TIERCKPT_TIER0``, ``TIERCKPT_TIER2``; tier-2 credentials the same way, for every
   store: :data:`~tierckpt.tier2.storage.url.CREDENTIAL_ENV`; an ``--export`` that drops
   the environment is refused) — nothing
   secret is written into the script — and exports them to the training command, which
   passes them to the library (``--tier1 '$TIERCKPT_TIER1'``; ``Tier0()`` reads
   ``TIERCKPT_TIER0`` itself: docs/schedulers.md);
   torchrun and every ``tierckpt`` call run under one interpreter, ``$TIERCKPT_PYTHON``
   (:func:`interpreter`), never a ``python`` looked up on the node's PATH;
3. runs one ``srun`` task per node, each a torchrun agent: c10d rendezvous on the first
   node, ``--nnodes MIN:MAX`` (the spares), ``--max-restarts`` (a rank killed inside the
   allocation restarts there), ``--signals-to-handle`` with SIGUSR1 and
   ``--shutdown-timeout`` covering the emergency save;
4. forwards the lead's USR1 to the step once its workers have taken a first step (before,
   it would kill them unsaved), and notes a SIGTERM (a user's ``scancel``);
5. after the step, asks ``tierckpt launch outcome`` and requeues itself
   (``scontrol requeue``) only after an announced interruption whose emergency save was
   committed — never after ``scancel``, never after the job finished — and only if the job
   did not already requeue itself (rank 0 does, after its emergency save:
   :mod:`tierckpt.preempt.requeue`; ``TIERCKPT_MAX_REQUEUES`` gives it the same limit).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

from tierckpt._version import __version__
from tierckpt.errors import ConfigError
from tierckpt.launch.outcome import EXIT_CONFIG
from tierckpt.launch.resources import sbatch_lines
from tierckpt.launch.torchrun import SIGNALS as SIGNALS  # where it was named first
from tierckpt.launch.torchrun import TorchrunJob, node_command
from tierckpt.runtime.scheduler import MAX_REQUEUES_ENV
from tierckpt.tier2.storage.url import CREDENTIAL_ENV, parse_url

WAIT_STEP = (
    "# wait returns early when a trapped signal arrives: wait until the step is gone.",
    "while :; do",
    '    wait "$step"; rc=$?',
    '    [ "$rc" -gt 128 ] && kill -0 "$step" 2>/dev/null || break',
    "done",
)
"""Wait for the background step ``$step``; its status in ``$rc``."""

FORWARD_USR1 = (
    'events="$TIERCKPT_TIER1/events.jsonl"',
    'offset=$(stat -c %s "$events" 2>/dev/null || echo 0)',
    "# A worker arms its notice handlers at its first should_stop(); a USR1 before that would",
    "# end it unsaved (the signal's default action). So pass the lead's USR1 on once this",
    "# run's workers have taken a step (first_step in the tier-1 root's events).",
    "first='\"event\": \"first_step\"'",
    "forward_usr1() {",
    '    until tail -c +$((offset + 1)) "$events" 2>/dev/null | grep -q "$first"; do',
    '        kill -0 "$step" 2>/dev/null || return',
    "        sleep 1",
    "    done",
    '    sleep 1; kill -USR1 "$step" 2>/dev/null',
    "}",
)
"""Bash: pass the lead's USR1 to the step ``$step`` once its workers train."""

TIERCKPT_FN = ("tierckpt() { \"$TIERCKPT_PYTHON\" -c 'import sys; from tierckpt.cli import "
               "main; sys.argv[0] = \"tierckpt\"; main()' \"$@\"; }")
"""A shell function running the CLI with ``$TIERCKPT_PYTHON`` (no PATH lookup)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmLaunch(TorchrunJob):
    """One sbatch script's settings: the :class:`~tierckpt.launch.torchrun.TorchrunJob`
    and Slurm's own. ``nodes`` train; ``spares`` more nodes are allocated and join
    torchrun's rendezvous, so the job goes on with ``nodes`` when one fails.
    ``max_requeues``: requeues after an emergency save at most. ``tier1``/``tier0``/
    ``tier2``: defaults for the ``TIERCKPT_TIER*`` variables (the submitter's environment
    wins). ``gpus_per_node``, ``cpus_per_node`` and ``memory`` become ``#SBATCH`` lines;
    ``sbatch``: more of them. ``python``: the interpreter the generator ran under (see
    :func:`interpreter`)."""

    max_requeues: int = 5
    job_name: str = "tierckpt"
    tier1: str | None = None
    tier0: str | None = None
    tier2: str | None = None
    sbatch: tuple[str, ...] = ()
    python: str = dataclasses.field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        self.check_node()
        if self.tier2 is not None:
            parse_url(self.tier2, name="--tier2")
        own = {"--gpus-per-node": self.gpus_per_node, "--cpus-per-task": self.cpus_per_node,
               "--mem": self.memory_mib}
        for name in ("nodes", "port"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1, got {getattr(self, name)}")
        for name in ("spares", "max_restarts", "max_requeues"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 0")
        for opt in self.sbatch:
            if not opt.startswith("-") or "\n" in opt:
                raise ConfigError(f"--sbatch {opt!r}: give one sbatch option, e.g. "
                                  "--sbatch=--time=04:00:00")
            if opt.split("=")[0] in ("--signal", "--requeue", "--no-requeue", "--open-mode"):
                raise ConfigError(f"--sbatch {opt!r}: the launcher sets {opt.split('=')[0]} "
                                  "itself (use --lead for the signal's lead)")
            if opt.split("=")[0] == "--export" and not opt.startswith("--export=ALL"):
                raise ConfigError(f"--sbatch {opt!r}: the tier paths and tier-2 credentials "
                                  "come from the submitter's environment, which sbatch "
                                  "exports by default; keep it (--export=ALL,NAME=value)")
            if own.get(opt.split("=")[0]):
                raise ConfigError(f"--sbatch {opt!r} and the launcher's own flag for it "
                                  "(--gpus-per-node, --cpus-per-node, --memory): give one")


def interpreter(s: SlurmLaunch) -> str:
    """The default of ``$TIERCKPT_PYTHON``, which runs torchrun and every ``tierckpt`` call:
    the command's interpreter when it is an absolute path (``/venv/bin/python train.py``),
    else the one that wrote the script (``s.python``). A bare ``python`` is not looked up
    on the node's PATH: there it may be another interpreter, without torch or tierckpt."""
    py = s.command.python
    return py if py is not None and os.path.isabs(py) else s.python


def comment_line(argv: list[str]) -> str:
    """``argv`` as one shell line that fits a ``#`` comment (a newline in an argument is
    written ``$'\\n'``)."""
    def word(a: str) -> str:
        if "\n" not in a:
            return shlex.quote(a)
        return "$'" + a.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
    return " ".join(word(a) for a in argv)


def _header(s: SlurmLaunch, argv: list[str]) -> list[str]:
    nodes = f"{s.nodes}-{s.max_nodes}" if s.spares else str(s.nodes)
    lines = [
        "#!/bin/bash",
        f"# Written by `tierckpt launch slurm` (tierckpt {__version__}); run this to write",
        "# it again:",
        "#   " + comment_line(argv),
        f"#SBATCH --job-name={s.job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{s.lead.seconds}",
    ]
    if s.spares:
        lines.append("#SBATCH --no-kill")
    lines += sbatch_lines(gpus=s.gpus_per_node, cpus=s.cpus_per_node, memory_mib=s.memory_mib)
    lines += [f"#SBATCH {opt}" for opt in s.sbatch]
    lines += [
        "#",
        f"# --signal lead and torchrun --shutdown-timeout: {s.lead.seconds} s:",
        f"#   {s.lead.source}.",
        "# Exit status: 0 all steps done; 75 preempted and saved (requeued unless the limit",
        f"# of {s.max_requeues} requeues is reached); {EXIT_CONFIG} a configuration error; "
        "else torchrun's.",
        "# torchrun and tierckpt run under $TIERCKPT_PYTHON (export it to choose another).",
    ]
    return lines


def _env(s: SlurmLaunch) -> list[str]:
    lines = ["", "# Tier paths and credentials come from the environment (sbatch exports it);",
             "# tier 2's, as its URL's store reads them:"]
    lines += [f"#   {scheme}://  {' '.join(names)}" for scheme, names in CREDENTIAL_ENV.items()]
    for var, default in (("TIERCKPT_TIER1", s.tier1), ("TIERCKPT_TIER0", s.tier0),
                         ("TIERCKPT_TIER2", s.tier2)):
        if default:
            lines.append(f"export {var}=\"${{{var}:-{_dq(default)}}}\"")
    lines += [
        f"export TIERCKPT_PYTHON=\"${{TIERCKPT_PYTHON:-{_dq(interpreter(s))}}}\"",
        f"export {MAX_REQUEUES_ENV}={s.max_requeues}  # the job's own requeue keeps this limit",
        'fail() { echo "tierckpt launch: $*" >&2; exit ' + str(EXIT_CONFIG) + "; }",
        '[ -x "$TIERCKPT_PYTHON" ] || fail "TIERCKPT_PYTHON=$TIERCKPT_PYTHON is not an '
        'interpreter on $(hostname): export TIERCKPT_PYTHON=/path/to/venv/bin/python"',
        TIERCKPT_FN,
        '[ -n "${TIERCKPT_TIER1:-}" ] || fail "set TIERCKPT_TIER1 to the tier-1 root '
        '(or pass --tier1 to tierckpt launch slurm)"',
        'mkdir -p "$TIERCKPT_TIER1" || fail "cannot create TIERCKPT_TIER1=$TIERCKPT_TIER1"',
        'command -v scontrol >/dev/null || fail "scontrol is not on PATH"',
    ]
    return lines


def _torchrun(s: SlurmLaunch) -> str:
    lines = node_command(
        s, python='"$TIERCKPT_PYTHON"',  # the interpreter of every tierckpt call: never PATH's
        host="$head", rdzv_id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}",
        node_id="$SLURMD_NODENAME")
    srun = "srun --ntasks-per-node=1 --kill-on-bad-exit=0" + (" --no-kill" if s.spares else "")
    return f"{srun} \\\n    " + " \\\n    ".join(lines) + " &"


def sbatch_script(s: SlurmLaunch, argv: list[str]) -> str:
    """The batch script for ``s``; ``argv`` (the generating command line) goes into its
    header."""
    body = [
        "",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "start=$(date +%s)",
        'echo "tierckpt launch: job $SLURM_JOB_ID run ${SLURM_RESTART_COUNT:-0} on '
        '$SLURM_JOB_NODELIST, rendezvous on $head"',
        "notices=''",
        "step=''",
        *FORWARD_USR1,
        "# The lead's USR1 reaches only this shell (B:): pass it to the step. A SIGTERM here",
        "# is a scancel or the time limit (preemption signals the step, not this shell).",
        "trap 'notices=\"$notices usr1\"; [ -n \"$step\" ] && forward_usr1 &' USR1",
        "trap 'notices=\"$notices term\"' TERM",
        _torchrun(s),
        "step=$!",
        *WAIT_STEP,
        "# again: requeue; requeued: the job already did (after its emergency save); stop.",
        'verdict=$(tierckpt launch outcome --tier1 "$TIERCKPT_TIER1" --since "$start" \\',
        '    --rc "$rc" --notices "$notices" --slurm-job "$SLURM_JOB_ID" '
        f'--max-requeues "${MAX_REQUEUES_ENV}")',
        "code=$?",
        'if [ "$verdict" = again ]; then',
        '    scontrol requeue "$SLURM_JOB_ID" || echo "tierckpt launch: scontrol requeue '
        'failed" >&2',
        "fi",
        'exit "$code"',
        "",
    ]
    return "\n".join(_header(s, argv) + _env(s) + body)


def _dq(text: str) -> str:
    """``text`` for inside double quotes: no expansion."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace(
        "`", "\\`")
