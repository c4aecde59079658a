"""The request log's hot path: records of plain values (what the live manager writes) skip the JSON
round trip in `normalize_record`, with the same result and the same errors."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from manager.replay.trace import parse_line
from manager.store.base import normalize_record

T0 = 1_764_547_200.0


def through_json(record: dict[str, Any]) -> dict[str, Any] | str:
    """What `normalize_record` gives when every record goes through JSON (its other path): the
    record with a value JSON reads back unchanged but of another type (a numpy float)."""
    wrapped = {k: (np.float64(v) if k == "t" and type(v) is float else v) for k, v in record.items()}
    try:
        return normalize_record(wrapped)
    except ValueError as e:
        return str(e)


def direct(record: dict[str, Any]) -> dict[str, Any] | str:
    try:
        return normalize_record(record)
    except ValueError as e:
        return str(e)


RECORDS: list[dict[str, Any]] = [
    {"t": T0, "model": "voice", "busy_s": 0.4},
    {"t": T0, "model": "voice", "busy_s": 1, "class": "realtime", "wait_s": 0.0, "outcome": "ok"},
    {"t": T0, "model": "world", "busy_s": 2.5, "kind": "session", "client": "den"},
    {"t": T0, "model": "voice", "busy_s": 0.4, "kind": "infer", "class": None},
    {"t": T0, "model": "v\udcff", "busy_s": 0.4},  # a lone surrogate: JSON escapes and restores it
    {"t": T0, "model": "", "busy_s": 0.4},
    {"t": T0, "model": 7, "busy_s": 0.4},
    {"t": T0, "model": "voice", "busy_s": -0.1},
    {"t": T0, "model": "voice", "busy_s": float("nan")},
    {"t": T0, "model": "voice", "busy_s": float("inf")},
    {"t": T0, "model": "voice", "busy_s": True},
    {"t": T0, "model": "voice", "busy_s": 10**400},
    {"t": T0, "busy_s": 0.4},
    {"t": T0, "model": "voice", "busy_s": 0.4, "kind": "batch"},
    {"t": T0, "model": "voice", "busy_s": 0.4, "class": 3},
    {"t": T0, "model": "voice", "busy_s": 0.4, "outcome": "maybe"},
]


@pytest.mark.parametrize("record", RECORDS, ids=range(len(RECORDS)))
def test_plain_records_normalize_as_through_json(record: dict[str, Any]) -> None:
    got, want = direct(record), through_json(record)
    assert got == want
    if isinstance(got, dict):  # and what it accepts exports to a valid trace line
        trace = {k: got[k] for k in ("t", "model", "busy_s", "class", "kind", "client") if k in got}
        assert parse_line(json.dumps(trace), 1).model == got["model"]


def test_values_json_cannot_hold_are_still_refused() -> None:
    with pytest.raises(ValueError, match="not plain JSON data"):
        normalize_record({"t": T0, "model": "voice", "busy_s": 0.4, "client": object()})
    with pytest.raises(ValueError, match="not plain JSON data"):
        normalize_record({"t": T0, "model": "voice", "busy_s": np.bool_(True)})
    with pytest.raises(ValueError, match="'busy_s'"):  # a bool, even as JSON's true, is no duration
        normalize_record({"t": T0, "model": "voice", "busy_s": True})
