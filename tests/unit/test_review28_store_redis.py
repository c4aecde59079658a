"""Review 28 on a private, real redis-server (tests/integration/redis_server.py: a failure, not a
skip, under CI=true when there is none).

A Redis restarted without its data (no persistence, as the README expects) made a new store id at
the next start, and the journal's records, kept for that very store while it was down at the stop,
were set aside as another store's for good. Now the store says its id was only just made, and the
records are sent to it.

A lag score of -inf passed the check `not v <= top`, and `int(-inf)` raised OverflowError out of
`requests()` and `trim_requests()` (a traceback in `residency trace export`). It is now a corrupt
lag set, told to `on_corrupt` (or raised as a StoreError) like an infinite one."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
from integration.redis_server import client, redis_clean, redis_url, rstore  # noqa: F401
from live_helpers import CONFIG
from test_review28_store_journal import _start_claim_read, _takes_its_records_as_come_back_empty

from manager.config import load_config
from manager.live import LiveManager
from manager.store import StoreError, open_store
from manager.store.base import StoreId
from manager.store.export import export_trace

T0 = 1_790_000_000.0


def test_a_redis_store_says_whether_this_ask_made_its_id_and_where_it_is(
    rstore: Any,  # noqa: F811
    redis_clean: str,  # noqa: F811
) -> None:
    first, again = rstore.store_id(), rstore.store_id()
    assert isinstance(first, StoreId) and first.made is True
    assert isinstance(again, StoreId) and again.made is False
    assert first == again
    port = redis_clean.rsplit(":", 1)[1].split("/", 1)[0]
    assert first.where == again.where == f"redis 127.0.0.1:{port}/0 {rstore.prefix}"


def test_a_redis_that_came_back_empty_takes_the_records_kept_for_it(
    redis_clean: str,  # noqa: F811
    client: Any,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    jp = tmp_path / "requests.journal"
    lm = LiveManager(load_config(CONFIG), None, store=open_store(redis_clean), clock=lambda: T0, journal=jp)
    assert _start_claim_read(lm) == []
    for i in range(3):  # served, then a stop with the store down: the journal keeps them
        lm._log({"t": T0 + i, "model": "voice", "busy_s": 0.25})
    assert lm.journal is not None and lm.store is not None
    lm.journal.close()
    lm.store.close()
    client.flushall()  # Redis restarted without its data
    lm = LiveManager(
        load_config(CONFIG), None, store=open_store(redis_clean), clock=lambda: T0 + 60, journal=jp
    )
    _takes_its_records_as_come_back_empty(lm, tmp_path, caplog)


@pytest.mark.parametrize("score", [-math.inf, -5.0])
def test_a_negative_lag_score_is_a_corrupt_lag_set_not_an_overflow(
    rstore: Any,  # noqa: F811
    client: Any,  # noqa: F811
    score: float,
) -> None:
    rstore.append_requests([{"t": 1000.0, "model": "a", "busy_s": 0.1}])
    client.zadd(rstore._lag_key, {"tracked_from": score})
    told: list[StoreError] = []
    got = list(rstore.requests(0, on_corrupt=told.append))
    assert [r["t"] for r in got] == [1000.0]  # read to the stream's end, the lateness unknown
    assert len(told) == 1 and "tracked_from score" in str(told[0])
    with pytest.raises(StoreError, match="tracked_from score"):
        list(rstore.requests(0))
    with pytest.raises(StoreError, match="tracked_from score"):
        rstore.trim_requests(500.0)
    skipped: list[Any] = []
    out = io.StringIO()
    assert export_trace(rstore, 1e9, 2000.0, out, skipped=skipped) == 1
    assert skipped
