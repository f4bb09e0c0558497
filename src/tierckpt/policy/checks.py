"""Validators shared by the component configs (``Writes``, ``Tier0``, ``Tier2``,
``Failures``): each raises :class:`~tierckpt.errors.ConfigError` naming the field in the
form a user writes it (``Writes.threads``), so the message says what to change."""

from __future__ import annotations

import enum
from typing import TypeVar

from tierckpt.errors import ConfigError

E = TypeVar("E", bound=enum.Enum)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is exactly True or False (``1`` or ``"yes"`` is a typo, not a flag)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def check_enum(name: str, kind: type[E], value: object) -> E:
    """``value`` as a member of ``kind``: a member, or its value (``"full"`` for
    ``Verify.FULL``); ConfigError listing the accepted values otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{name} must be one of {[m.value for m in kind]}, "
                          f"got {value!r}") from None


def check_mode(name: str, value: object) -> int:
    """A permission mode that is an int and not world-writable (``0o640``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value & 0o002:
        raise ConfigError(f"{name} must be an int mode that is not world-writable "
                          f"(e.g. 0o640), got {value!r}")
    return value
