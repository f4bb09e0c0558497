"""Parsing of durations, sizes and counts: values, and errors that name the argument."""

from __future__ import annotations

import pytest

from tierckpt.errors import ConfigError
from tierckpt.policy.units import (
    format_bytes,
    format_duration,
    format_rate,
    parse_count,
    parse_duration,
    parse_rate,
    parse_size,
)


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90.0), ("15m", 900.0), ("12h", 43200.0), ("32d", 32 * 86400.0), ("600", 600.0),
    ("1h30m", 5400.0), ("250ms", 0.25), ("2w", 14 * 86400.0), ("1.5h", 5400.0),
    (" 5 s ", 5.0), ("15min", 900.0), ("1e3s", 1000.0), ("12H", 43200.0),
])
def test_parse_duration_values(text: str, seconds: float) -> None:
    assert parse_duration(text, "--x") == pytest.approx(seconds)


@pytest.mark.parametrize(("text", "fragment"), [
    ("5x", "unknown duration unit 'x'"), ("-5s", "must be positive"), ("0s", "positive"),
    ("", "empty"), ("abc", "cannot read"), ("5s!", "cannot read"), ("1y", "unknown"),
])
def test_parse_duration_errors_name_the_argument(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="--restart") as info:
        parse_duration(text, "--restart")
    assert fragment in str(info.value)


def test_parse_duration_zero_only_when_allowed() -> None:
    assert parse_duration("0s", "--restart", allow_zero=True) == 0.0
    with pytest.raises(ConfigError, match="--blocking"):
        parse_duration(0.0, "--blocking")
    with pytest.raises(ConfigError, match="--blocking"):
        parse_duration(float("nan"), "--blocking")


@pytest.mark.parametrize(("text", "nbytes"), [
    ("2TiB", 2 * 2**40), ("980GB", 980 * 10**9), ("512MiB", 512 * 2**20), ("4096", 4096),
    ("1.5kB", 1500), ("2gib", 2 * 2**30), ("10B", 10), ("1TB", 10**12),
])
def test_parse_size_values(text: str, nbytes: int) -> None:
    assert parse_size(text, "--node-ram") == nbytes


@pytest.mark.parametrize("text", ["2TX", "-1GB", "0", "GB", "2 parsecs"])
def test_parse_size_errors_name_the_argument(text: str) -> None:
    with pytest.raises(ConfigError, match="--node-ram"):
        parse_size(text, "--node-ram")


@pytest.mark.parametrize(("text", "bps"), [
    ("1GB/s", 1e9), ("200MB/s", 2e8), ("1.5GiB/s", 1.5 * 2**30), (" 500 MB / s ", 5e8),
    ("10kB/sec", 1e4),
])
def test_parse_rate_values(text: str, bps: float) -> None:
    assert parse_rate(text, "--tier1-rate") == bps


@pytest.mark.parametrize("text", ["1GB", "1GB/m", "fast/s", "-1GB/s", "0/s", "/s"])
def test_parse_rate_errors_name_the_argument(text: str) -> None:
    with pytest.raises(ConfigError, match="--tier1-rate"):
        parse_rate(text, "--tier1-rate")


def test_format_rate() -> None:
    assert format_rate(1.25e9) == "1.2 GB/s"


@pytest.mark.parametrize(("text", "count"), [
    ("70e9", 70_000_000_000), ("70B", 70_000_000_000), ("8b", 8_000_000_000),
    ("1.5T", 1_500_000_000_000), ("350M", 350_000_000), ("125k", 125_000), ("1000", 1000),
])
def test_parse_count_values(text: str, count: int) -> None:
    assert parse_count(text, "--params") == count


@pytest.mark.parametrize("text", ["70X", "-3", "0", "7 B B", "lots"])
def test_parse_count_errors_name_the_argument(text: str) -> None:
    with pytest.raises(ConfigError, match="--params"):
        parse_count(text, "--params")


def test_formatting() -> None:
    assert format_duration(45) == "45.0 s"
    assert format_duration(2276.8) == "37.9 min"
    assert format_duration(43200) == "12.0 h"
    assert format_duration(32 * 86400) == "32.0 d"
    assert format_bytes(980e9) == "980.0 GB"
    assert format_bytes(122.5e9) == "122.5 GB"
    assert format_bytes(512) == "512 B"
