"""Sizes and durations: parsing, formatting, round trips and error messages."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from manager.units import format_duration, format_size, parse_duration, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("100KiB", 100 * KiB),
        ("2TiB", 2 * TiB),
        ("10GB", 10 * 10**9),
        ("500MB", 500 * 10**6),
        ("1kB", 1000),
        ("123", 123),
        ("123B", 123),
        ("24 gib", 24 * GiB),
        ("  1536 MiB ", 1536 * MiB),
        ("0", 0),
        (".5KiB", 512),
    ],
)
def test_parse_size_strings(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_numbers() -> None:
    assert parse_size(0) == 0
    assert parse_size(4096) == 4096
    assert parse_size(1024.0) == 1024
    assert isinstance(parse_size(1024.0), int)


@pytest.mark.parametrize("bad", ["abc", "", "GiB", "1.5.3GiB", "12 parsecs", "-1", "-1GiB", "1e9", "5 G"])
def test_parse_size_rejects_bad_strings(bad: str) -> None:
    with pytest.raises(ValueError, match=r"expected a size like '24GiB', '512MiB' or a number of bytes, got"):
        parse_size(bad)


@pytest.mark.parametrize("bad", [-1, -0.5, True, False, math.inf, math.nan])
def test_parse_size_rejects_bad_numbers(bad: float) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(bad)


def test_parse_size_refuses_sizes_beyond_int64_fields() -> None:
    assert parse_size("1024PiB") == parse_size(2**60) == 2**60
    for bad in ("1025PiB", 2**60 + 1, 2**70):
        with pytest.raises(ValueError, match="at most 1024PiB"):
            parse_size(bad)


def test_parse_size_error_quotes_the_input() -> None:
    with pytest.raises(ValueError) as info:
        parse_size("abc")
    assert str(info.value) == "expected a size like '24GiB', '512MiB' or a number of bytes, got 'abc'"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("45s", 45.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1w", 604800.0),
        ("500ms", 0.5),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("1.5h", 5400.0),
        ("1H30M", 5400.0),
        ("90", 90.0),
        ("0.25", 0.25),
        ("1m30.1s", 90.1),
        ("0s", 0.0),
    ],
)
def test_parse_duration_strings(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


def test_parse_duration_numbers() -> None:
    assert parse_duration(45) == 45.0
    assert parse_duration(0.5) == 0.5
    assert isinstance(parse_duration(3), float)


@pytest.mark.parametrize("bad", ["abc", "", "h", "1h30", "30 minutes", "-1s", "1hh", "ms", "forever", "1e3s"])
def test_parse_duration_rejects_bad_strings(bad: str) -> None:
    with pytest.raises(ValueError, match=r"expected a duration like '30m', '2h', '45s' or seconds, got"):
        parse_duration(bad)


@pytest.mark.parametrize("bad", [-1, True, math.inf, math.nan])
def test_parse_duration_rejects_bad_numbers(bad: float) -> None:
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (1024, "1KiB"),
        (24 * GiB, "24GiB"),
        (3 * GiB // 2, "1.5GiB"),
        (512 * MiB, "512MiB"),
        (1200 * MiB, "1200MiB"),
        (1536 * MiB, "1.5GiB"),
        (10 * 10**9, "10GB"),
        (1000, "1kB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text
    assert parse_size(text) == n


def test_format_size_rounds_awkward_values() -> None:
    assert format_size(1_000_001) == "976.56KiB"


@pytest.mark.parametrize("bad", [-1, True])
def test_format_size_rejects_bad_values(bad: int) -> None:
    with pytest.raises(ValueError, match="non-negative number of bytes"):
        format_size(bad)


@pytest.mark.parametrize(
    ("s", "text"),
    [
        (1800, "30m"),
        (7200.0, "2h"),
        (5400, "1h30m"),
        (45, "45s"),
        (0.5, "0.5s"),
        (0, "0s"),
        (90061, "1d1h1m1s"),
        (90.1, "1m30.1s"),
        (math.inf, "forever"),
    ],
)
def test_format_duration(s: float, text: str) -> None:
    assert format_duration(s) == text


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_format_duration_rejects_bad_values(bad: float) -> None:
    with pytest.raises(ValueError, match="non-negative number of seconds"):
        format_duration(bad)


_UNITS = st.sampled_from(["B", "KiB", "MiB", "GiB", "TiB"])
_FACTORS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}


@given(count=st.integers(min_value=0, max_value=9999), unit=_UNITS)
def test_format_size_round_trips_whole_units(count: int, unit: str) -> None:
    n = count * _FACTORS[unit]
    assert parse_size(format_size(n)) == n
    assert parse_size(f"{count}{unit}") == n


@given(count=st.integers(min_value=1, max_value=1023), unit=st.sampled_from(["KiB", "MiB", "GiB", "TiB"]))
def test_format_size_spells_whole_units_exactly(count: int, unit: str) -> None:
    assert format_size(count * _FACTORS[unit]) == f"{count}{unit}"


@given(st.integers(min_value=0, max_value=10**15))
def test_format_size_always_parses_back_within_rounding(n: int) -> None:
    # Inexact spellings round to two decimals of a unit the value is at least 1 of: <= 0.5% off.
    assert abs(parse_size(format_size(n)) - n) <= n * 0.005 + 1


@given(st.integers(min_value=0, max_value=10**8))
def test_format_duration_round_trips_whole_seconds(s: int) -> None:
    assert parse_duration(format_duration(s)) == s


@given(st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False))
def test_format_duration_round_trips_floats(s: float) -> None:
    assert parse_duration(format_duration(s)) == pytest.approx(s, rel=1e-12, abs=1e-9)


@pytest.mark.parametrize("huge", ["9" * 400, "9" * 400 + "w", "9" * 310 + "h30m", 10**400])
def test_parse_duration_refuses_numbers_too_large_for_a_float(huge: int | str) -> None:
    # float() of these is inf: a duration must stay finite ("forever" is the keep-alive's own word)
    with pytest.raises(ValueError, match="too large"):
        parse_duration(huge)


@pytest.mark.parametrize("typo", ["1m1m", "30m1h", "5ms5m", "1s1S", "1h 2h"])
def test_parse_duration_takes_each_unit_once_largest_first(typo: str) -> None:
    """`1m1m` was read as 2 minutes and `30m1h` as 90 minutes: a repeated or misordered unit is far
    more likely a typo than meant, so it is refused, saying how to write it."""
    with pytest.raises(ValueError, match=r"each unit once, largest first \(e\.g\. '1h30m'\)"):
        parse_duration(typo)
    assert parse_duration("1w2d3h4m5s6ms") == 604800 + 2 * 86400 + 3 * 3600 + 4 * 60 + 5 + 0.006
