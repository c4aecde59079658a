"""Review 16, the request log's retention on a private, real redis-server: `trim_requests(before)`
deletes every entry of the stream whose record is older than `before` and no other, in bounded steps,
the late records too (ids placed ahead of their t, by up to the lag in `<prefix>:requests:lag`)."""

from __future__ import annotations

from typing import Any

import pytest

import manager.store.redis as redis_mod
from manager.store import StoreError

T0 = 1_790_000_000.0


def _rec(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.5}


def test_old_entries_go_in_steps_and_recent_ones_stay(
    rstore: Any, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_mod, "TRIM_CHUNK", 3)  # several steps
    rstore.append_requests([_rec(T0 + i) for i in range(10)])
    assert rstore.trim_requests(T0 + 7) == 7
    assert [r["t"] for r in rstore.requests(0)] == [T0 + 7, T0 + 8, T0 + 9]
    assert rstore.trim_requests(T0 + 7) == 0  # t == before stays
    assert rstore.trim_requests(T0 + 7.0005) == 1  # the same ms as T0 + 7, and older: it goes
    assert rstore.count_requests() == 2
    with pytest.raises(ValueError, match="before must be a number"):
        rstore.trim_requests(float("nan"))


def test_late_records_older_than_before_go_too(rstore: Any, client: Any) -> None:
    """A record written after a later one is stored at the later one's id: an id range alone (XTRIM
    MINID) would keep it, older than the retention, until the log's time passed its id."""
    rstore.append_requests([_rec(T0 + 10.0)])
    rstore.append_requests([_rec(T0 + 2.0, "late"), _rec(T0 + 8.0, "late-but-recent")])
    assert int(client.zscore("residency:requests:lag", "late_ms")) == 8000
    assert rstore.trim_requests(T0 + 5.0) == 1
    assert [(r["t"], r["model"]) for r in rstore.requests(0)] == [
        (T0 + 8.0, "late-but-recent"),
        (T0 + 10.0, "voice"),
    ]


def test_trimming_everything_keeps_the_stream_writable(rstore: Any, client: Any) -> None:
    assert rstore.trim_requests(T0) == 0  # no stream yet
    assert rstore.trim_requests(0.0004) == 0  # below the first ms: no id to go
    rstore.append_requests([_rec(T0), _rec(T0 + 1.0)])
    assert rstore.trim_requests(float("inf")) == 2
    assert rstore.count_requests() == 0
    rstore.append_requests([_rec(T0 + 2.0)])
    assert [r["t"] for r in rstore.requests(0)] == [T0 + 2.0]


def test_another_programs_key_is_a_store_error(rstore: Any, client: Any) -> None:
    client.set("residency:requests", "not a stream")
    with pytest.raises(StoreError, match=r"trim requests: .*WRONGTYPE"):
        rstore.trim_requests(T0)
