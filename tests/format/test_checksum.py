"""CRC32C helpers: combine agrees with hashing the concatenation."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierckpt.format import checksum


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes) -> None:
    got = checksum.combine(checksum.extend(0, a), checksum.extend(0, b), len(b))
    assert got == checksum.extend(0, a + b)


def test_combine_at_large_lengths() -> None:
    a, b = os.urandom(17), os.urandom((1 << 22) + 5)
    assert checksum.combine(checksum.extend(0, a), checksum.extend(0, b), len(b)) == \
        checksum.extend(0, a + b)


def test_combine_past_512_mib() -> None:
    """2^29 bytes is 2^32 bits, where a 32-entry x^(2^n) table would wrap."""
    a, b = os.urandom(17), bytes((1 << 29) + 4096)
    assert checksum.combine(checksum.extend(0, a), checksum.extend(0, b), len(b)) == \
        checksum.extend(checksum.extend(0, a), b)


def test_combine_refuses_negative_length() -> None:
    with pytest.raises(ValueError, match="len2"):
        checksum.combine(1, 2, -1)
