"""The training command as torchrun takes it, and its shell form. Pure.

``python train.py --tier1 $TIERCKPT_TIER1`` becomes torchrun's ``train.py --tier1 ...``;
``python -m pkg.train`` becomes ``-m pkg.train``; a program that is not Python runs under
``--no-python``. In the shell form an argument that refers to a variable (``$NAME`` or
``${NAME}``) is double-quoted so the job's shell expands it; every other argument is quoted
literally.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Sequence

from tierckpt.errors import ConfigError

_VAR = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """``python`` (the interpreter that runs torchrun; None: the job's ``python3``) and
    ``argv``: what follows torchrun's own flags (``train.py ARGS``, ``-m MOD ARGS``, or
    ``--no-python PROG ARGS``)."""

    python: str | None
    argv: tuple[str, ...]


def split(command: Sequence[str], *, launcher: str = "launch slurm") -> TrainCommand:
    """Split a training command (``python train.py ...``, ``train.py ...``, ``-m mod``, or
    any program) into the interpreter and torchrun's arguments. ConfigError when empty or
    when the command is torchrun itself (the launcher adds torchrun); ``launcher`` (``launch
    slurm``, ``launch k8s``) is the subcommand the error's example names."""
    argv = list(command)
    if not argv:
        raise ConfigError("no training command: put it after --, e.g. "
                          f"`tierckpt {launcher} -- python train.py --steps 1000`")
    head = os.path.basename(argv[0])
    if head in ("torchrun",) or argv[1:3] == ["-m", "torch.distributed.run"]:
        raise ConfigError("give the training command without torchrun: the launcher runs "
                          "torchrun with the flags a preemption needs")
    if _PYTHON.match(head):
        rest = argv[1:]
        if not rest:
            raise ConfigError(f"{argv[0]} needs a script or -m MODULE after it")
        return TrainCommand(argv[0], tuple(rest))
    if argv[0] == "-m" or argv[0].endswith(".py"):
        return TrainCommand(None, tuple(argv))
    return TrainCommand(None, ("--no-python", *argv))


def shell_word(arg: str) -> str:
    """``arg`` quoted for bash: literally, unless it refers to a variable (then in double
    quotes, with ``"``, ``\\`` and backquotes escaped, so only the variable expands)."""
    if _VAR.search(arg) and "$(" not in arg:
        return '"' + re.sub(r'(["\\`])', r"\\\1", arg) + '"'
    return shlex.quote(arg)


def shell_line(argv: Sequence[str]) -> str:
    """``argv`` as one bash command line (see :func:`shell_word`)."""
    return " ".join(shell_word(a) for a in argv)
