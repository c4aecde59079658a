"""Bad trace lines (hypothesis): random JSON values, good lines with one field swapped for a value of
another type, and random text. `parse_line` returns a Request or raises ValueError with a one-line
reason; `read_trace` never raises without `--strict`, counts every bad line with its number, and
keeps the good ones."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manager.policy.types import Request
from manager.replay.trace import TraceError, parse_line, read_trace

GOOD = {"t": 100.0, "model": "voice", "busy_s": 0.4, "class": "realtime", "kind": "infer", "client": "c"}
FIELDS = [*GOOD, "extra"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 80), max_value=1 << 80)
    | st.floats()
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _dumps(v: Any) -> str:
    return json.dumps(v)  # NaN and Infinity come out as the non-standard tokens json.loads accepts


@st.composite
def lines(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["mutated", "value", "text", "deep"]))
    if kind == "mutated":
        obj: dict[str, Any] = dict(GOOD)
        key = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()) and key in obj:
            del obj[key]
        else:
            obj[key] = draw(json_values)
        return _dumps(obj)
    if kind == "value":
        return _dumps(draw(json_values))
    if kind == "deep":
        n = draw(st.integers(min_value=1, max_value=50_000))
        return draw(st.sampled_from(["[", '{"t":'])) * n
    return draw(st.text(max_size=200)).replace("\n", " ").replace("\r", " ")


def _check_reason(reason: str) -> None:
    assert reason and "\n" not in reason and "Traceback" not in reason


@settings(max_examples=400, deadline=None)
@given(line=lines())
def test_a_random_line_parses_or_gets_a_one_line_reason(line: str) -> None:
    try:
        r = parse_line(line, 1, None, None)
    except ValueError as e:
        _check_reason(str(e))
        return
    assert isinstance(r, Request)
    assert math.isfinite(r.t) and r.t >= 0 and math.isfinite(r.busy_s) and r.busy_s >= 0
    assert isinstance(r.model, str) and r.model


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.lists(lines(), min_size=1, max_size=8))
def test_a_file_of_random_lines_is_read_with_every_bad_line_counted(tmp_path: Path, bad: list[str]) -> None:
    good = [
        _dumps({"t": 1.0, "model": "voice", "busy_s": 0.1}),
        _dumps({"t": 2.0, "model": "llm", "busy_s": 1.0}),
    ]
    text = [good[0], *bad, good[1]]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(text) + "\n", encoding="utf-8")
    got = read_trace(p)
    numbers = {n for n, _ in got.bad_lines}
    assert all(2 <= n <= len(text) for n in numbers)  # the last good line may come out of time order
    for _, reason in got.bad_lines:
        _check_reason(reason)
    assert got.requests[0].model == "voice"  # the first good line always survives
    assert len(got.requests) + len(got.bad_lines) == sum(1 for line in text if line.strip())
    if got.bad_lines:
        with pytest.raises(TraceError) as err:
            read_trace(p, strict=True)
        assert err.value.line == min(numbers)


@pytest.mark.parametrize("line", ["[" * 100_000, '{"t":' * 100_000, '{"t": ' + "9" * 5000 + "}"])
def test_pathological_lines_are_bad_lines_not_crashes(line: str) -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_line(line, 7, None, None)
