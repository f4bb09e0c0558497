"""What a command needs beyond the ``cli`` extra.

``tierckpt --help`` and the commands that do not read tensors (plan, size, simulate, ls,
verify, upload, fetch, gc, doctor, report) start without importing torch. The commands that
do (inspect, export, drill) import their library modules inside the command function, under
:func:`needs_torch`, so that a missing torch ends in a red line naming what to install, exit
status 1, rather than a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tierckpt.cli._tiers import fail


def torch_missing(what: str) -> str:
    """The message for ``what`` (``"tierckpt inspect"``) run without torch."""
    return f"{what} needs PyTorch, which is not installed: pip install torch"


def is_torch(e: ImportError) -> bool:
    """Whether ``e`` says that torch, or one of its modules, cannot be imported."""
    return (e.name or "").partition(".")[0] == "torch"


@contextmanager
def needs_torch(command: str) -> Iterator[None]:
    """Wrap the imports of a command that needs torch: an ImportError of torch (or of one of
    its modules) becomes :func:`torch_missing` on stderr and exit status 1. Wrap only the
    imports, not the command's work, so that a later ImportError keeps its traceback."""
    try:
        yield
    except ImportError as e:
        if not is_torch(e):
            raise
        raise fail(f"{torch_missing(f'tierckpt {command}')} (the commands that read no "
                   "tensors run without it)") from None
