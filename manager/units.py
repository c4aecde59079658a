"""Sizes and durations as people write them in configs: `24GiB`, `512MiB`, `30m`, `1h30m`.

Pure and stdlib-only. Parsing is exact (decimal arithmetic), so `1.5GiB` is exactly 1610612736 bytes
and `1m30.1s` is 90.1 seconds; formatting picks the shortest exact spelling when there is one.
"""

from __future__ import annotations

import datetime
import math
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext

__all__ = [
    "DURATION_PATTERN",
    "MAX_DURATION_S",
    "SIZE_PATTERN",
    "ZERO_DURATION_PATTERN",
    "ZERO_SIZE_PATTERN",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_keep_alive",
    "parse_size",
    "shown",
]

_SIZE_EXPECTED = "expected a size like '24GiB', '512MiB' or a number of bytes"
MAX_SIZE = 2**60
"""The largest size accepted (1024 PiB): every size must fit the int64 fields of the store and the protos."""
_DURATION_EXPECTED = "expected a duration like '30m', '2h', '45s' or seconds"
MAX_DURATION_S = 10 * 365 * 86400
"""The longest duration a config or a request's keep-alive takes (ten years; `forever` is the way to
say "never"): times near float's limits would turn the replay's sums into infinity, and a keep-alive
of 1e40 s printed as a duration took more digits than `format_duration`'s arithmetic holds."""

# Binary (IEC) and decimal (SI) units, lower-cased. Bare "k/m/g/t" are rejected as ambiguous.
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
# What format_size tries, in order: binary units largest first, then decimal ones.
_FORMAT_SIZE_UNITS: tuple[tuple[str, int], ...] = (
    ("PiB", 1 << 50),
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("PB", 10**15),
    ("TB", 10**12),
    ("GB", 10**9),
    ("MB", 10**6),
    ("kB", 10**3),
)

_DURATION_UNITS: dict[str, Decimal] = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
    "w": Decimal(604800),
}
_DURATION_UNITS_ORDER: tuple[str, ...] = ("w", "d", "h", "m", "s", "ms")
"""The order a duration's parts are written in, each at most once: `1h30m`, not `30m1h` or `1m1m`
(which a summing reader would take as 2 minutes: most likely a typo)."""
_FORMAT_DURATION_UNITS: tuple[tuple[str, int], ...] = (("d", 86400), ("h", 3600), ("m", 60))

# ASCII digits only: `\d` would also take '٣' or '５', which no other reader of a config (the JSON
# Schema, YAML's own numbers) does
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_SIZE_RE = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-z]*)\s*$")

_PLAIN_NUMBER_RE = re.compile(rf"^\s*{_NUMBER}\s*$")


def _any_case(unit: str) -> str:
    """`unit` as a pattern of either case without flags (JSON Schema patterns take none): [mM][sS]."""
    return "".join(f"[{c.lower()}{c.upper()}]" for c in unit)


_ZERO = r"(?:0+(?:\.0*)?|\.0+)"
# Units spelled in either case letter by letter, not with re.IGNORECASE: that also takes 'ſ' (U+017F)
# for 's', a unit no table here has (parse_duration failed on it with Python's own message)
_DURATION_PART_RE = re.compile(rf"\s*({_NUMBER})\s*({'|'.join(_any_case(u) for u in _DURATION_UNITS)})\s*")
_SIZE_UNIT_PATTERN = "|".join(_any_case(u) for u in sorted(_SIZE_UNITS, key=len, reverse=True) if u)


def _size_pattern(number: str) -> str:
    return rf"^\s*{number}\s*(?:{_SIZE_UNIT_PATTERN})?\s*$"


def _duration_pattern(number: str) -> str:
    # each unit at most once, largest first (as parse_duration reads them); the lookahead keeps an
    # empty or blank string out, since every part is optional
    parts = "".join(rf"(?:\s*{number}\s*{_any_case(u)}\s*)?" for u in _DURATION_UNITS_ORDER)
    return rf"^(?:\s*{number}\s*|(?=\s*[0-9.]){parts})$"


SIZE_PATTERN = _size_pattern(_NUMBER)
"""The strings parse_size reads, as a regular expression JSON Schema can use (what the config's
schema says of a size; the value may still be too large)."""
DURATION_PATTERN = _duration_pattern(_NUMBER)
"""The strings parse_duration reads, as a regular expression JSON Schema can use."""
ZERO_SIZE_PATTERN = _size_pattern(_ZERO)
"""The strings of SIZE_PATTERN that write a zero (`0`, `0GiB`, `0.0 MiB`): what the schema says a
size that must be positive is not."""
ZERO_DURATION_PATTERN = _duration_pattern(_ZERO)
"""The strings of DURATION_PATTERN whose every part is a zero (`0`, `0s`, `0m0s`)."""


SHOWN_MAX = 60
"""The longest value an error message quotes; longer ones are cut short."""


def shown(v: object, limit: int = SHOWN_MAX) -> str:
    """`repr(v)` for an error message, at most `limit` characters. An integer too large to print
    (Python refuses to turn one of more than 4300 digits into text) is described, never converted."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 3 * limit:
        return f"an integer of about {int(v.bit_length() * math.log10(2)) + 1} digits"
    if isinstance(v, datetime.date | datetime.time):  # YAML turns an unquoted 2026-12-05 into a date
        is_datetime = isinstance(v, datetime.datetime)
        text = v.isoformat(sep=" ") if isinstance(v, datetime.datetime) else v.isoformat()
        kind = "date-time" if is_datetime else type(v).__name__
        return f"the {kind} {text} (YAML reads it unquoted as one: put it in quotes)"
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(v: int | float, expected: str) -> Decimal:
    """A non-negative finite number given as int/float (bool is not a number here)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{expected}, got {shown(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{expected}, got {shown(v)}")
    if v < 0:
        raise ValueError(f"{expected}; it must not be negative, got {shown(v)}")
    return Decimal(v) if isinstance(v, int) else Decimal(repr(v + 0.0))  # + 0.0: -0.0 is 0.0


def parse_size(v: int | float | str) -> int:
    """Bytes from `24GiB`, `512MiB`, `1.5GiB`, `10GB` (decimal), `123`, `123B` or a number.

    Units are case-insensitive; a space between number and unit is allowed. A fraction of a byte
    counts as a whole byte (rounded up: `0.4` is 1 byte, not 0, so a size written non-zero is never
    read as zero, and one at most N is never read as more than N: the JSON Schema's bounds say the
    same). Raises ValueError saying what was expected.
    """
    if isinstance(v, str):
        m = _SIZE_RE.match(v)
        unit = _SIZE_UNITS.get(m.group(2).lower()) if m else None
        if m is None or unit is None:
            raise ValueError(f"{_SIZE_EXPECTED}, got {shown(v)}")
        try:
            value = Decimal(m.group(1)) * unit
        except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid numbers
            raise ValueError(f"{_SIZE_EXPECTED}, got {shown(v)}") from exc
    else:
        value = _number(v, _SIZE_EXPECTED)
    size = int(value.to_integral_value(rounding=ROUND_CEILING))
    if size > MAX_SIZE:
        raise ValueError(f"expected a size of at most 1024PiB, got {shown(v)}")
    return size


def parse_duration(v: int | float | str) -> float:
    """Seconds from `45s`, `30m`, `2h`, `1d`, `1w`, `500ms`, `1h30m`, `1.5h`, `90` or a number.

    Units are case-insensitive. Raises ValueError saying what was expected (negative, infinite or
    NaN values are errors; `forever` is the keep-alive's business, not a duration).
    """
    if not isinstance(v, str):
        return _finite(float(_number(v, _DURATION_EXPECTED)), v)
    if _PLAIN_NUMBER_RE.match(v):
        return _finite(float(Decimal(v.strip())), v)
    total = Decimal(0)
    pos = 0
    rank = -1
    for m in _DURATION_PART_RE.finditer(v):
        if m.start() != pos:
            break
        unit = m.group(2).lower()
        if _DURATION_UNITS_ORDER.index(unit) <= rank:
            raise ValueError(
                f"{_DURATION_EXPECTED}; write each unit once, largest first (e.g. '1h30m'), got {shown(v)}"
            )
        rank = _DURATION_UNITS_ORDER.index(unit)
        total += Decimal(m.group(1)) * _DURATION_UNITS[unit]
        pos = m.end()
    if pos == 0 or pos != len(v):
        raise ValueError(f"{_DURATION_EXPECTED}, got {shown(v)}")
    return _finite(float(total), v)


KEEP_ALIVE_EXPECTED = (
    "expected a keep-alive: a duration like '10m' or seconds (0: off the GPU once idle), or 'forever' "
    "(a negative number of seconds is forever too, as Ollama reads it)"
)


def parse_keep_alive(v: int | float | str, *, bounded: bool = True) -> float:
    """A request's own keep-alive (Ollama's `keep_alive`), in seconds: a duration (`10m`, `90`),
    `forever` (infinity), or a negative number or duration (forever, as Ollama reads `-1`, `-1m`).
    `bounded` (a request's: the gRPC calls): at most MAX_DURATION_S, as the config's; a trace line or
    a stored record is not bounded (an earlier release logged any value: refused, those requests
    would be lost from the journal and the log). Raises ValueError saying what was expected."""
    negative = False
    if isinstance(v, str):
        text = v.strip()
        if text.lower() == "forever":
            return math.inf
        if text.startswith("-"):  # Ollama's "-1", "-1m": forever ("-0s" is 0, as Go reads it)
            v, negative = text[1:], True
    elif (isinstance(v, int) and not isinstance(v, bool) and v < 0) or (  # (an int of 400 digits too)
        isinstance(v, float) and math.isinf(v)  # (a double: inf, and -inf as a negative number)
    ):
        return math.inf
    elif isinstance(v, float) and v < 0:
        v, negative = -v, True
    try:
        seconds = parse_duration(v)
    except ValueError:
        raise ValueError(f"{KEEP_ALIVE_EXPECTED}, got {shown(v if not negative else f'-{v}')}") from None
    if negative:  # (however large: forever)
        return math.inf if seconds > 0 else seconds
    if bounded and seconds > MAX_DURATION_S:  # as the config's keep_alive: that large is forever, say so
        raise ValueError(
            f"expected a keep-alive of at most 3650d (ten years), or 'forever' (or a negative number) "
            f"for no expiry, got {shown(v, 40)}"
        )
    return seconds


def _finite(seconds: float, v: int | float | str) -> float:
    """`seconds`, unless it is too large for a float (a 400-digit number would become infinity)."""
    if not math.isfinite(seconds):
        raise ValueError(f"{_DURATION_EXPECTED}; this one is too large, got {shown(v, 40)}")
    return seconds


def _decimal_str(d: Decimal) -> str:
    """`d` in plain positional notation without trailing zeros: 1.50 -> '1.5', 2E+1 -> '20'."""
    text = format(d, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def format_size(n: int) -> str:
    """Human spelling of `n` bytes that parse_size reads back: 24GiB, 1.5GiB, 1200MiB, 10GB, 0B.

    Exact whenever a unit spells `n` with at most two decimals and fewer than five digits before
    the point (always for whole multiples of a unit below 10000); binary units are preferred.
    Otherwise the largest binary unit, rounded to two decimals (1000001 -> '976.56KiB').
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"expected a non-negative number of bytes, got {n!r}")
    for name, unit in _FORMAT_SIZE_UNITS:
        if unit <= n < unit * 10000 and (n * 100) % unit == 0:
            return f"{_decimal_str(Decimal(n * 100 // unit) / 100)}{name}"
    if n < 10000:
        return f"{n}B"
    name, unit = next((name, unit) for name, unit in _FORMAT_SIZE_UNITS if n >= unit)
    return f"{_decimal_str(round(Decimal(n) / unit, 2))}{name}"


def format_duration(s: float) -> str:
    """Human spelling of `s` seconds that parse_duration reads back: 30m, 2h, 1h30m, 45s, 0.5s.

    Infinity is "forever" (a keep-alive that never expires). Exact: the parts add up to `s`.
    """
    if isinstance(s, bool) or not isinstance(s, int | float) or math.isnan(s) or s < 0:
        raise ValueError(f"expected a non-negative number of seconds, got {s!r}")
    if math.isinf(s):
        return "forever"
    with localcontext() as exact:  # (28 digits by default: 1e40 s failed, DivisionImpossible)
        exact.prec = 400  # more than a float's 309 integer digits and 17 significant ones
        rest = Decimal(s) if isinstance(s, int) else Decimal(repr(s + 0.0))  # -0.0 is "0s", not "-0s"
        parts: list[str] = []
        for name, unit in _FORMAT_DURATION_UNITS:
            count = int(rest // unit)
            if count:
                parts.append(f"{count}{name}")
                rest -= count * unit
        if rest or not parts:
            parts.append(f"{_decimal_str(rest)}s")
    return "".join(parts)
