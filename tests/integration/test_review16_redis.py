"""Review 16 of the Redis store on a private, real redis-server: a damaged lag set (the lateness
that widens each time range, `<prefix>:requests:lag`) is a StoreError naming the key, never an
OverflowError out of `requests` (which `trace export` and the statistics' catch-up read)."""

from __future__ import annotations

from typing import Any

import pytest

from manager.store import StoreError

T0 = 1_790_000_000.0


@pytest.mark.parametrize("score", [float("inf"), 1e300])
def test_a_damaged_lag_score_is_named(rstore: Any, client: Any, score: float) -> None:
    """Bug: a late_ms score of inf raised OverflowError (int(inf)) out of `requests`, a traceback
    from `residency trace export`; one of 1e300 was sent to Redis as a stream id it refused
    ("Invalid stream ID"), naming neither the key nor what was wrong with it."""
    rstore.append_requests([{"t": T0, "model": "voice", "busy_s": 0.5}])
    client.zadd("residency:requests:lag", {"late_ms": score})
    with pytest.raises(StoreError, match=r"residency:requests:lag is corrupt: its late_ms score"):
        list(rstore.requests(T0 - 10.0, T0 + 10.0))


def test_a_sane_lag_still_reads_late_records(rstore: Any) -> None:
    """A record written after a later one (its id placed ahead of its t) still reads back in time
    order within its range."""
    rstore.append_requests([{"t": T0 + 5.0, "model": "voice", "busy_s": 0.5}])
    rstore.append_requests([{"t": T0, "model": "embed", "busy_s": 0.5}])
    got = [r["model"] for r in rstore.requests(T0 - 1.0, T0 + 1.0)]
    assert got == ["embed"]
    assert [r["model"] for r in rstore.requests(T0 - 1.0)] == ["embed", "voice"]
