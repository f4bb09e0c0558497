"""The one check both framework drop-ins apply to the state they save as plain values."""

from __future__ import annotations

import io
from typing import Any

import torch

from tierckpt.errors import ConfigError


def weights_only_problem(value: object) -> str | None:
    """Why ``value`` would not survive ``torch.save`` then ``torch.load(weights_only=True)``
    (what a restore unpickles) — ``"TypeName: first line"`` — or None when it does."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:  # whatever torch.save or the weights_only unpickler refuses
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def require_plain(what: str, value: Any) -> Any:
    """``value``, if it survives ``torch.save`` and ``torch.load(weights_only=True)``; else
    a ConfigError naming ``what`` and the fix."""
    problem = weights_only_problem(value)
    if problem is not None:
        raise ConfigError(
            f"{what} does not load with torch.load(weights_only=True), so a restart could not "
            f"read it ({problem}); return dicts, lists, numbers, strings and tensors from it, "
            "or register the class with torch.serialization.add_safe_globals")
    return value
