"""A batch of the Redis request log is written whole or not at all (a real redis-server)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from manager.store import StoreError
from manager.store.redis import RedisStore

from .redis_server import redis_clean, redis_url  # noqa: F401

T0 = 1764547200.0


def req(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.4}


def test_a_batch_with_a_time_beyond_stream_ids_writes_nothing(rstore: RedisStore) -> None:
    rstore.append_requests([req(T0)])
    with pytest.raises(ValueError, match="milliseconds"):  # 2e16 s is past a stream id's 64-bit ms
        rstore.append_requests([req(T0 + 5, "a"), req(2e16, "b"), req(T0 + 6, "c")])
    assert [r["model"] for r in rstore.requests(0)] == ["voice"]


def test_a_batch_that_fails_in_redis_writes_none_of_its_records(
    rstore: RedisStore, client: redis.Redis
) -> None:
    rstore.append_requests([req(T0 + 10)])
    client.set("residency:requests:lag", "not a sorted set")  # the batch's late record needs it
    with pytest.raises(StoreError, match="append requests"):
        rstore.append_requests([req(T0 + 20, "a"), req(T0 + 5, "late"), req(T0 + 30, "c")])
    client.delete("residency:requests:lag")
    assert rstore.count_requests() == 1
    rstore.append_requests([req(T0 + 20, "a"), req(T0 + 5, "late")])  # in one batch, out of order
    assert [r["model"] for r in rstore.requests(0)] == ["late", "voice", "a"]
    assert [r["model"] for r in rstore.requests(T0, T0 + 6)] == ["late"]
