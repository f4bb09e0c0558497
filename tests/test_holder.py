"""A lease's holder (tierckpt/_holder.py): judged gone only when it ran on this boot, in
this PID namespace, and no process with its id and start time runs now."""

from __future__ import annotations

import json
import subprocess
import sys

from tierckpt import _holder


def _child_holder() -> dict[str, object]:
    """The holder of a real process that has exited (as a SIGKILLed sweep has)."""
    out = subprocess.run([sys.executable, "-c", "import json; from tierckpt._holder import me; "
                          "print(json.dumps(me()))"], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def test_an_exited_process_is_gone_and_a_running_one_is_not() -> None:
    me = _holder.me()
    assert set(me) == {"boot", "pid_ns", "pid", "start"}
    assert not _holder.gone(me)
    dead = _child_holder()
    assert dead["boot"] == me["boot"] and dead["pid"] != me["pid"]
    assert _holder.gone(dead)


def test_a_reused_pid_is_told_apart_by_its_start_time() -> None:
    me = _holder.me()
    assert isinstance(me["start"], int)
    assert _holder.gone({**me, "start": me["start"] - 1})  # our pid, an earlier process


def test_a_holder_that_cannot_be_judged_here_is_never_gone() -> None:
    dead = _child_holder()
    for other in ({**dead, "boot": "another-boot"}, {**dead, "pid_ns": 1},
                  {**dead, "pid": "7"}, {**dead, "pid": True}, {"pid": 1}, {}):
        assert not _holder.gone(other), other
