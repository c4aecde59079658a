"""Review of the Redis store against a real redis-server: each test is a bug found and fixed."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import redis

from manager.store import Store, StoreError, open_store
from manager.store.redis import RedisStore, open_redis

from .redis_server import redis_clean, redis_url  # noqa: F401

T0 = 1_764_547_200.0

# Holds the server for 0.8 s: Redis reads no socket meanwhile, so commands sent now run after it.
BUSY_LUA = """
local s = redis.call('TIME')
repeat local n = redis.call('TIME') until (n[1] - s[1]) * 1000000 + (n[2] - s[2]) > 800000
return 1
"""


def req(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.4}


def test_a_batch_redis_py_sends_again_after_a_timeout_is_written_once(
    redis_clean: str,  # noqa: F811 - the imported fixture
) -> None:
    """redis-py sends a command again when its reply times out (the store's Retry); a busy server
    runs both copies once it is free, so one append_requests wrote its batch twice (and returned
    success). Each call now marks its batch in the script; the second copy writes nothing."""
    busy = redis.Redis.from_url(redis_clean, socket_timeout=10)
    with closing(open_redis(redis_clean, timeout_s=0.2)) as store:
        store.append_requests([req(T0, "a")])
        th = threading.Thread(target=busy.eval, args=(BUSY_LUA, 0))
        th.start()
        time.sleep(0.1)
        # it times out once or twice, then answers; or every try times out (a StoreError: the caller
        # keeps the batch), and what Redis ran late counts once all the same
        with contextlib.suppress(StoreError):
            store.append_requests([req(T0 + 1, "b")])
        th.join()
        deadline = time.monotonic() + 5
        while store.count_requests() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # any later copy has run by now
        assert [r["model"] for r in store.requests(0)] == ["a", "b"]
        store.append_requests([req(T0 + 2, "c")])  # later batches are not taken for copies
        assert [r["model"] for r in store.requests(0)] == ["a", "b", "c"]
    busy.close()


@pytest.fixture(params=["redis", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    url = request.getfixturevalue("redis_clean") if request.param == "redis" else f"sqlite:///{tmp_path}/s.db"
    s = open_store(url)
    yield s
    s.close()


@pytest.mark.parametrize(
    ("since", "until", "want"),
    [
        (0.0, -math.inf, []),  # Redis: OverflowError (no stream id for -inf)
        (0.0, -5.0, []),
        (0.0, 1e300, ["a", "b"]),  # Redis: StoreError "Invalid stream ID"
        (0.0, 2e16, ["a", "b"]),
        (1e300, None, []),
        (T0 + 1, T0 + 1, []),
        (T0 + 1, T0, []),
        (-math.inf, math.inf, ["a", "b"]),
        (T0 + 0.5, 1e300, ["b"]),
    ],
)
def test_ranges_past_any_stream_id_are_ranges_all_the_same(
    store: Store, since: float, until: float | None, want: list[str]
) -> None:
    """`requests(since, until)` is since <= t < until for any numbers: the SQLite store answered
    these, the Redis store raised for bounds it could not turn into a stream id."""
    store.append_requests([req(T0, "a"), req(T0 + 1, "b")])
    assert [r["model"] for r in store.requests(since, until)] == want


def test_the_redis_store_is_the_one_under_test(redis_clean: str) -> None:  # noqa: F811
    with closing(open_store(redis_clean)) as s:
        assert isinstance(s, RedisStore)
