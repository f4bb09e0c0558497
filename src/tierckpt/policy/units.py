"""Parsing and formatting of durations, byte sizes and counts given on the command line.

Every parser takes the text and the *name of the argument* it came from (``"--blocking"``,
``"restart"``) and raises :class:`~tierckpt.errors.ConfigError` naming that argument, so the
message tells the user which flag to fix. Results are plain numbers: seconds as ``float``,
bytes and counts as ``int``.

Durations: a number with an optional unit, or several joined (``90s``, ``15m``, ``12h``,
``32d``, ``1h30m``, ``250ms``, ``2w``); a bare number is seconds. Sizes: a number with a
decimal (``kB MB GB TB PB``, powers of 1000) or binary (``KiB MiB GiB TiB PiB``, powers of
1024) unit, or ``B``; a bare number is bytes. Counts: ``70e9``, ``70B``, ``8B``, ``1.5T``,
``350M`` (K, M, B/G, T are powers of 1000 — ``B`` means billion here, not bytes). Rates: a
size per second (``1GB/s``, ``200MB/s``, ``1.5GiB/s``).
"""

from __future__ import annotations

import math
import re

from tierckpt.errors import ConfigError

_DURATION_UNITS: dict[str, float] = {
    "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0,
    "d": 86400.0, "day": 86400.0, "w": 7 * 86400.0,
}
_SIZE_UNITS: dict[str, int] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_COUNT_UNITS: dict[str, float] = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_TERM = re.compile(rf"\s*({_NUMBER})\s*([a-zA-Z]*)")


def _terms(text: str, name: str, kind: str, example: str) -> list[tuple[float, str]]:
    s = text.strip()
    if not s:
        raise ConfigError(f"{name}: empty {kind}; give e.g. {example}")
    if s.startswith("-"):
        raise ConfigError(f"{name}: {kind} must be positive, got {text!r}")
    out: list[tuple[float, str]] = []
    pos = 0
    while pos < len(s):
        m = _TERM.match(s, pos)
        if m is None or m.end() == pos:
            raise ConfigError(f"{name}: cannot read {text!r} as a {kind}; give e.g. {example}")
        out.append((float(m.group(1)), m.group(2)))
        pos = m.end()
    return out


def parse_duration(text: str | float, name: str, *, allow_zero: bool = False) -> float:
    """Seconds in ``text`` (``"90s"``, ``"15m"``, ``"12h"``, ``"32d"``, ``"1h30m"``, ``"600"``).

    Raises ConfigError naming ``name`` for an unknown unit, a negative value, or zero unless
    ``allow_zero``.
    """
    example = "90s, 15m, 12h or 32d"
    if isinstance(text, (int, float)):
        total = float(text)
    else:
        total = 0.0
        for value, unit in _terms(text, name, "duration", example):
            key = unit.lower() or "s"
            if key not in _DURATION_UNITS:
                raise ConfigError(
                    f"{name}: unknown duration unit {unit!r} in {text!r}; "
                    f"use ms, s, m, h, d or w (e.g. {example})")
            total += value * _DURATION_UNITS[key]
    return check_duration(total, name, allow_zero=allow_zero)


def check_duration(seconds: float, name: str, *, allow_zero: bool = False) -> float:
    """``seconds`` as a float if it is finite and positive (or zero with ``allow_zero``)."""
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        need = "zero or positive" if allow_zero else "positive"
        raise ConfigError(f"{name}: duration must be {need} and finite, got {seconds!r} s")
    return float(seconds)


def check_seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    """``value`` as a float if it is a finite number of seconds, > 0 (or >= 0 with
    ``allow_zero``), else :class:`ConfigError` naming ``name``. A bool is refused (``True``
    is not a timeout), as are ``inf`` and ``nan`` (they break every deadline computed from
    them). The validator of timeouts given as numbers, as :func:`check_count` is of counts."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be a finite number of seconds {need}, got {value!r}")
    return float(value)


def parse_size(text: str | int, name: str, *, allow_zero: bool = False) -> int:
    """Bytes in ``text`` (``"2TiB"``, ``"980GB"``, ``"4096"``); ConfigError naming ``name``."""
    example = "2TiB, 980GB or 512MiB"
    if isinstance(text, int):
        total = float(text)
    else:
        total = 0.0
        for value, unit in _terms(text, name, "size", example):
            key = unit.lower() or "b"
            if key == "k":  # a lone "k" is common shorthand for kB
                key = "kb"
            if key not in _SIZE_UNITS:
                raise ConfigError(
                    f"{name}: unknown size unit {unit!r} in {text!r}; use B, kB, MB, GB, TB "
                    f"(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. {example}")
            total += value * _SIZE_UNITS[key]
    if not math.isfinite(total) or total < 0 or (total == 0 and not allow_zero):
        raise ConfigError(f"{name}: size must be positive, got {text!r}")
    return round(total)


def parse_rate(text: str, name: str) -> float:
    """Bytes per second in ``text``: a size, then ``/s`` (``"1GB/s"``, ``"200MiB/s"``);
    ConfigError naming ``name``."""
    body, slash, per = text.strip().rpartition("/")
    if not slash or per.strip().lower() not in ("s", "sec"):
        raise ConfigError(f"{name}: cannot read {text!r} as a rate; give a size per second, "
                          "e.g. 1GB/s or 200MiB/s")
    return float(parse_size(body, name))


def parse_count(text: str | float, name: str) -> int:
    """A positive count such as a parameter count (``"70e9"``, ``"70B"``, ``"1.5T"``)."""
    example = "70e9, 70B or 1.5T"
    if isinstance(text, (int, float)):
        total = float(text)
    else:
        terms = _terms(text, name, "count", example)
        if len(terms) != 1:
            raise ConfigError(f"{name}: cannot read {text!r} as a count; give e.g. {example}")
        value, unit = terms[0]
        key = unit.lower()
        if key and key not in _COUNT_UNITS:
            raise ConfigError(
                f"{name}: unknown count suffix {unit!r} in {text!r}; use K, M, B (billion) or "
                f"T, e.g. {example}")
        total = value * (_COUNT_UNITS[key] if key else 1.0)
    if not math.isfinite(total) or total < 1:
        raise ConfigError(f"{name}: must be a positive count, got {text!r}")
    return round(total)


def check_count(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else :class:`ConfigError`
    naming the knob both as a keyword (``keep_last``) and as a flag (``keep-last``). The
    one validator of retention and cadence counts, wherever they come from."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        off = " (0 = off)" if minimum == 0 else ""
        raise ConfigError(f"{name} ({name.replace('_', '-')}) must be an int >= {minimum}"
                          f"{off}, got {value!r}")
    return value


def format_duration(seconds: float) -> str:
    """A short human form: ``"45.0 s"``, ``"37.9 min"``, ``"12.0 h"``, ``"3.2 d"``."""
    s = abs(seconds)
    if not math.isfinite(s):
        return str(seconds)
    if s < 120:
        return f"{seconds:.1f} s"
    if s < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if s < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def format_rate(bps: float) -> str:
    """``format_bytes`` per second: ``"1.2 GB/s"``."""
    return f"{format_bytes(bps)}/s"


def format_bytes(n: float) -> str:
    """Decimal units, as in the design notes: ``"980.0 GB"``, ``"122.5 GB"``, ``"2.2 TB"``."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(value) < 1000 or unit == "PB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
