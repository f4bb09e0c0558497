"""The one check both framework drop-ins apply to the state they save as plain values."""

from __future__ import annotations

import io

import torch


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
