"""The JSONL request-trace contract: reading, writing, and how bad lines are reported."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from manager.policy.types import Request
from manager.replay.trace import (
    TraceError,
    parse_line,
    read_trace,
    request_to_json,
    write_trace,
)

MODELS = ("voice", "tts", "llm", "world")


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text(text, encoding="utf-8")
    return p


class TestRoundTrip:
    def test_write_then_read_equals(self, tmp_path: Path) -> None:
        reqs = [
            Request(t=1764547200.0, model="voice", busy_s=0.4),
            Request(t=1764547200.0, model="llm", busy_s=2.5, cls="realtime", client="voice"),
            Request(t=1764547201.125, model="world", busy_s=5400.0, kind="session", client="world-app"),
        ]
        path = tmp_path / "sub" / "dir" / "week.jsonl"  # parents are created
        assert write_trace(path, reqs) == 3
        got = read_trace(path)
        assert got.requests == reqs
        assert got.bad_lines == []
        assert got.path == str(path)

    def test_json_is_compact_and_omits_defaults(self) -> None:
        r = Request(t=1.23456, model="voice", busy_s=0.40049)
        assert request_to_json(r) == '{"t":1.235,"model":"voice","busy_s":0.4}'
        r = Request(t=5.0, model="world", busy_s=60.0, cls="background", kind="session", client="c")
        assert request_to_json(r) == (
            '{"t":5.0,"model":"world","busy_s":60.0,"class":"background","kind":"session","client":"c"}'
        )

    @given(
        t=st.floats(min_value=0, max_value=1e11, allow_nan=False, allow_infinity=False),
        busy=st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False),
        model=st.text(min_size=1, max_size=12),
        cls=st.none() | st.text(max_size=8),
        kind=st.sampled_from(["infer", "session"]),
        client=st.none() | st.text(max_size=8),
    )
    def test_any_valid_request_round_trips(
        self, t: float, busy: float, model: str, cls: str | None, kind: str, client: str | None
    ) -> None:
        r = Request(t=t, model=model, busy_s=busy, cls=cls, kind=kind, client=client)
        back = parse_line(request_to_json(r), 1, None, None)
        assert math.isclose(back.t, t, abs_tol=1e-3)
        assert math.isclose(back.busy_s, busy, abs_tol=1e-3)
        assert (back.model, back.cls, back.kind, back.client) == (model, cls, kind, client)


class TestBadLines:
    @pytest.mark.parametrize(
        ("line", "needle"),
        [
            ("{not json", "not valid JSON"),
            ("[1, 2]", "not a JSON object"),
            ('{"model": "voice", "busy_s": 1}', "missing field 't'"),
            ('{"t": 1, "busy_s": 1}', "missing field 'model'"),
            ('{"t": 1, "model": "voice"}', "missing field 'busy_s'"),
            ('{"t": 1, "model": "voice", "busy_s": "x"}', "'busy_s' must be a finite number ≥ 0, got 'x'"),
            ('{"t": 1, "model": "voice", "busy_s": true}', "'busy_s' must be a finite number ≥ 0, got True"),
            ('{"t": -1, "model": "voice", "busy_s": 1}', "'t' must be a finite number ≥ 0, got -1"),
            ('{"t": NaN, "model": "voice", "busy_s": 1}', "'t' must be a finite number ≥ 0, got nan"),
            ('{"t": 1e999, "model": "voice", "busy_s": 1}', "'t' must be a finite number ≥ 0, got inf"),
            ('{"t": 1, "model": "voice", "busy_s": -0.5}', "'busy_s' must be a finite number ≥ 0"),
            ('{"t": 1793577600000, "model": "voice", "busy_s": 1}', "Unix seconds ≤ 1e11, got 1793577600000"),
            ('{"t": 1e19, "model": "voice", "busy_s": 1}', "(milliseconds?)"),
            ('{"t": 1, "model": "voice", "busy_s": Infinity}', "'busy_s' must be a finite number ≥ 0"),
            ('{"t": 1, "model": 3, "busy_s": 1}', "'model' must be a non-empty string, got 3"),
            ('{"t": 1, "model": "", "busy_s": 1}', "'model' must be a non-empty string"),
            ('{"t": 1, "model": "voice", "busy_s": 1, "kind": "batch"}', "'kind' must be one of"),
            ('{"t": 1, "model": "voice", "busy_s": 1, "kind": ["infer"]}', "'kind' must be one of"),
            ('{"t": 1, "model": "voice", "busy_s": 1, "class": 2}', "'class' must be a string, got 2"),
            ('{"t": 1, "model": "voice", "busy_s": 1, "client": {}}', "'client' must be a string"),
            ('{"t": 1, "model": "voice", "busy_s": 1, "prio": 1}', "unknown field 'prio' (allowed: t,"),
            ('{"t": 1, "model": "sora", "busy_s": 1}', "unknown model 'sora' (known: llm, tts,"),
            ('{"t": 1, "model": "voice", "busy_s": 1, "class": "vip"}', "unknown class 'vip' (known: bg"),
        ],
    )
    def test_reason_names_the_problem_and_line(self, tmp_path: Path, line: str, needle: str) -> None:
        good = '{"t": 0, "model": "voice", "busy_s": 1}\n'
        path = _write(tmp_path, good + line + "\n" + good.replace('"t": 0', '"t": 5'))
        got = read_trace(path, known_models=MODELS, known_classes=("rt", "bg"))
        assert len(got.requests) == 2  # the good lines around the bad one survive
        [(line_no, reason)] = got.bad_lines
        assert line_no == 2
        assert needle in reason

    def test_strict_raises_with_line_number(self, tmp_path: Path) -> None:
        path = _write(tmp_path, '{"t": 0, "model": "voice", "busy_s": 1}\n\n{"t": 1}\n')
        with pytest.raises(TraceError) as ei:
            read_trace(path, strict=True)
        assert ei.value.line == 3  # blank lines still count
        assert ei.value.reason == "missing field 'model'"
        assert ei.value.path == str(path)
        assert str(ei.value) == f"{path}:3: missing field 'model'"

    def test_out_of_order_is_bad_and_does_not_move_the_clock(self, tmp_path: Path) -> None:
        path = _write(
            tmp_path,
            '{"t": 10, "model": "voice", "busy_s": 1}\n'
            '{"t": 5, "model": "voice", "busy_s": 1}\n'
            '{"t": 10, "model": "llm", "busy_s": 1}\n',  # equal to the last good t: fine
        )
        got = read_trace(path)
        assert [r.model for r in got.requests] == ["voice", "llm"]
        assert got.bad_lines == [(2, "out of time order: t=5.0 after t=10.0 (line 1)")]

    def test_blank_lines_are_skipped_silently(self, tmp_path: Path) -> None:
        path = _write(tmp_path, '\n  \n{"t": 0, "model": "voice", "busy_s": 1}\n\n\t\n')
        got = read_trace(path, strict=True)
        assert len(got.requests) == 1
        assert got.bad_lines == []

    def test_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(TraceError) as ei:
            read_trace(tmp_path / "nope.jsonl")
        assert (ei.value.line, ei.value.reason) == (0, "no such file")

    def test_long_values_are_cut_short_in_reasons(self) -> None:
        with pytest.raises(ValueError, match=r"got 'xxx.*\.\.\.$") as ei:
            parse_line('{"t": 0, "model": "voice", "busy_s": "' + "x" * 5000 + '"}', 1, None, None)
        assert len(str(ei.value)) < 120

    def test_null_optional_fields_mean_absent(self) -> None:
        line = '{"t": 0, "model": "voice", "busy_s": 1, "class": null, "client": null, "kind": null}'
        r = parse_line(line, 1, None, None)
        assert r == Request(t=0.0, model="voice", busy_s=1.0)

    def test_a_byte_order_mark_before_the_first_line_is_not_a_bad_line(self, tmp_path: Path) -> None:
        path = tmp_path / "bom.jsonl"
        path.write_text('{"t": 0, "model": "voice", "busy_s": 1}\n', encoding="utf-8-sig")
        got = read_trace(path, strict=True)
        assert got.requests == [Request(t=0.0, model="voice", busy_s=1.0)]


def test_unknown_model_lists_the_known_ones_sorted() -> None:
    with pytest.raises(ValueError) as ei:
        parse_line('{"t": 1, "model": "sora", "busy_s": 1}', 1, {"tts", "llm"}, None)
    assert str(ei.value) == "unknown model 'sora' (known: llm, tts)"
