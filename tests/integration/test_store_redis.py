"""The store contract against a real redis-server (and, side by side, the SQLite store, so the two
backends are held to the same behaviour), plus what only Redis has: late records in a stream whose
ids only grow, key prefixes, a server that is not there, corrupt stream entries."""

from __future__ import annotations

import json
import math
import random
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import redis

from manager.replay.trace import read_trace
from manager.store import Store, StoreError, open_store
from manager.store import redis as redis_store
from manager.store.export import export_trace
from manager.store.redis import RedisStore

from .redis_server import redis_clean, redis_url  # noqa: F401

T0 = 1_764_547_200.0


def req(t: float, model: str = "voice", busy_s: float = 0.4, **extra: Any) -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": busy_s, **extra}


@pytest.fixture(params=["redis", "sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store url: the private redis-server (flushed), or an SQLite file."""
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_clean")
        return url
    return f"sqlite:///{tmp_path}/state.db"


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    yield s
    s.close()


class TestContract:
    """The same behaviour from both backends."""

    def test_ranges_are_half_open_and_in_time_order(self, store: Store) -> None:
        store.append_requests([req(T0, "voice"), req(T0 + 1, "world"), req(T0 + 2, "llm")])
        store.append_requests([req(T0 + 2, "voice"), req(T0 + 3, "llm")])
        assert [r["t"] - T0 for r in store.requests(0)] == [0, 1, 2, 2, 3]
        assert [r["model"] for r in store.requests(T0 + 1, T0 + 3)] == ["world", "llm", "voice"]
        assert list(store.requests(T0 + 0.0005, T0 + 0.9995)) == []
        assert store.count_requests() == 5

    def test_unbounded_and_empty_ranges(self, store: Store) -> None:
        store.append_requests([req(0.0, "epoch"), req(T0, "now")])
        assert [r["model"] for r in store.requests(-math.inf, math.inf)] == ["epoch", "now"]
        assert [r["model"] for r in store.requests(-5.0, 0.001)] == ["epoch"]
        assert list(store.requests(-5.0, 0.0)) == []
        assert list(store.requests(math.inf)) == []
        with pytest.raises(ValueError, match="nan"):
            list(store.requests(math.nan))

    def test_sub_millisecond_bounds(self, store: Store) -> None:
        # Several records share one stream-id millisecond; the exact t decides.
        store.append_requests([req(T0 + 0.0001, "a"), req(T0 + 0.0004, "b"), req(T0 + 0.0009, "c")])
        assert [r["model"] for r in store.requests(T0 + 0.0004, T0 + 0.0009)] == ["b"]
        assert [r["t"] for r in store.requests(0)] == [T0 + 0.0001, T0 + 0.0004, T0 + 0.0009]

    def test_records_come_back_canonical(self, store: Store) -> None:
        store.append_requests(
            [
                {"t": 1, "model": "voice", "busy_s": 0, "kind": "infer", "client": None},
                req(
                    2.5, "world", 600, kind="session", client="app", wait_s=1.25, outcome="error", source="x"
                ),
            ]
        )
        assert list(store.requests(0)) == [
            {"t": 1.0, "model": "voice", "busy_s": 0.0},
            {
                "t": 2.5,
                "model": "world",
                "busy_s": 600.0,
                "kind": "session",
                "client": "app",
                "wait_s": 1.25,
                "outcome": "error",
                "source": "x",
            },
        ]

    def test_unknown_key_is_rejected(self, store: Store) -> None:
        with pytest.raises(ValueError, match="'payload'"):
            store.append_requests([req(T0), req(T0, payload="<audio>")])
        assert store.count_requests() == 0

    def test_docs_and_intents_round_trip(self, store: Store) -> None:
        assert store.get_doc("load-costs") is None
        store.put_doc("load-costs", {"voice": {"disk": 3.0, "host": 0.4}, "v": [1, None]})
        store.put_doc("config/2", {"keep_alive": "30m"})
        assert store.get_doc("load-costs") == {"voice": {"disk": 3.0, "host": 0.4}, "v": [1, None]}
        store.put_doc("load-costs", {})
        assert store.get_doc("load-costs") == {}
        store.set_intent("voice", "gpu")
        store.set_intent("llm", "host")
        store.set_intent("llm", "disk")
        assert store.intents() == {"llm": "disk", "voice": "gpu"}
        with pytest.raises(ValueError, match="'cpu'"):
            store.set_intent("llm", "cpu")

    def test_a_restart_sees_the_data(self, store_url: str) -> None:
        with closing(open_store(store_url)) as s:
            s.append_requests([req(T0, "voice"), req(T0 + 1, "llm")])
            s.put_doc("stats", {"n": 2})
            s.set_intent("voice", "gpu")
        with closing(open_store(store_url)) as s:
            assert s.ping()
            assert [r["model"] for r in s.requests(T0)] == ["voice", "llm"]
            assert s.get_doc("stats") == {"n": 2}
            assert s.intents() == {"voice": "gpu"}

    def test_closed_store(self, store_url: str) -> None:
        s = open_store(store_url)
        s.close()
        s.close()
        assert not s.ping()
        with pytest.raises(StoreError, match="closed"):
            s.get_doc("x")

    def test_export_round_trip(self, store: Store, tmp_path: Path) -> None:
        store.append_requests(
            [
                req(T0 - 10, "before"),
                req(T0, "voice", wait_s=0.1, outcome="ok"),
                req(T0 + 5, "world", 90.0, kind="session", client="app", source="grpc"),
                req(T0 + 10, "after"),
            ]
        )
        out = tmp_path / "trace.jsonl"
        assert export_trace(store, 10.0, T0 + 10, out) == 2
        assert [json.loads(line) for line in out.read_text().splitlines()] == [
            {"t": T0, "model": "voice", "busy_s": 0.4},
            {"t": T0 + 5, "model": "world", "busy_s": 90.0, "kind": "session", "client": "app"},
        ]
        assert [r.model for r in read_trace(out, strict=True).requests] == ["voice", "world"]


class TestRedisStreams:
    def test_layout_under_the_prefix(self, redis_clean: str, client: redis.Redis) -> None:  # noqa: F811
        with closing(open_store(redis_clean.replace("/0", "/0?prefix=home1"))) as s:
            assert s.url.endswith("?prefix=home1")
            s.append_requests([req(T0 + 0.0015), req(T0 + 0.0015)])
            s.put_doc("stats", {"n": 1})
            s.set_intent("voice", "host")
        ids = [eid for eid, _ in client.xrange("home1:requests")]
        assert ids == [f"{int(T0 * 1000) + 1}-0".encode(), f"{int(T0 * 1000) + 1}-1".encode()]
        assert json.loads(client.hget("home1:docs", "stats") or b"") == {"n": 1}
        assert client.hgetall("home1:intents") == {b"voice": b"host"}
        with closing(open_store(redis_clean)) as other:  # the default prefix sees none of it
            assert other.count_requests() == 0
            assert other.get_doc("stats") is None

    def test_late_records_are_kept_in_time_order(self, rstore: RedisStore) -> None:
        # Threads finish out of order: a record older than the stream's newest id.
        rstore.append_requests([req(T0 + 10, "a"), req(T0 + 5, "late1")])
        rstore.append_requests([req(T0 + 11, "b")])
        rstore.append_requests([req(T0 + 2, "late2"), req(T0 + 12, "c")])
        assert rstore.count_requests() == 5
        assert [r["model"] for r in rstore.requests(0)] == ["late2", "late1", "a", "b", "c"]
        # A range ending before the late records' stream ids still finds them by their t.
        assert [r["model"] for r in rstore.requests(T0, T0 + 6)] == ["late2", "late1"]
        assert [r["model"] for r in rstore.requests(T0 + 5, T0 + 11)] == ["late1", "a"]

    def test_late_records_across_pages(self, rstore: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(redis_store, "PAGE", 3)
        times = [T0 + 100 + i for i in range(10)] + [T0 + 50 + i for i in range(5)]
        for t in times:
            rstore.append_requests([req(t, f"m{t - T0:g}")])
        got = [r["t"] for r in rstore.requests(T0 + 52, T0 + 105)]
        assert got == sorted(t for t in times if T0 + 52 <= t < T0 + 105)
        assert [r["t"] for r in rstore.requests(0)] == sorted(times)

    def test_equal_times_across_pages(self, rstore: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(redis_store, "PAGE", 2)
        rstore.append_requests([req(T0, f"m{i}") for i in range(7)])
        assert [r["model"] for r in rstore.requests(T0, T0 + 1)] == [f"m{i}" for i in range(7)]

    def test_late_records_from_racing_threads(self, rstore: RedisStore) -> None:
        def work(k: int) -> None:
            rng = random.Random(k)
            for i in range(40):
                rstore.append_requests([req(T0 + rng.uniform(0, 100), f"m{k}-{i}")])

        threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        everything = list(rstore.requests(0))
        assert len(everything) == rstore.count_requests() == 240
        assert [r["t"] for r in everything] == sorted(r["t"] for r in everything)
        window = [r["t"] for r in rstore.requests(T0 + 20, T0 + 30)]
        assert window == sorted(r["t"] for r in everything if T0 + 20 <= r["t"] < T0 + 30)

    def test_corrupt_entry_names_its_id(self, rstore: RedisStore, client: redis.Redis) -> None:
        rstore.append_requests([req(T0)])
        no_busy = json.dumps({"t": T0 + 1, "model": "x"})
        client.xadd("residency:requests", {"data": no_busy}, id="1764547201000-0")
        client.xadd("residency:requests", {"payload": "x"}, id="1764547202000-0")
        with pytest.raises(StoreError, match=r"entry 1764547201000-0 of residency:requests is corrupt.*busy"):
            list(rstore.requests(0))
        with pytest.raises(StoreError, match=r"entry 1764547202000-0 .* no 'data' field"):
            list(rstore.requests(T0 + 2))
        client.hset("residency:docs", "stats", b"\xff{")
        with pytest.raises(StoreError, match="document 'stats' is corrupt"):
            rstore.get_doc("stats")
        client.hset("residency:intents", "voice", "moon")
        with pytest.raises(StoreError, match=r"intent for 'voice' .* is corrupt"):
            rstore.intents()

    def test_wrong_key_type_is_a_store_error(self, rstore: RedisStore, client: redis.Redis) -> None:
        client.set("residency:requests", "not a stream")
        with pytest.raises(StoreError, match="append requests: ResponseError: WRONGTYPE"):
            rstore.append_requests([req(T0)])


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.count_requests(),
        lambda s: s.append_requests([req(T0)]),
        lambda s: list(s.requests(0)),
        lambda s: s.get_doc("x"),
        lambda s: s.set_intent("voice", "gpu"),
    ],
    ids=["count", "append", "read", "get_doc", "set_intent"],
)
def test_unreachable_server(call: Callable[[Store], object]) -> None:
    port = _closed_port()
    with closing(open_store(f"redis://:hunter2@127.0.0.1:{port}/0")) as s:
        assert s.ping() is False
        with pytest.raises(StoreError) as e:
            call(s)
    msg = str(e.value)
    assert f"redis://:***@127.0.0.1:{port}/0" in msg
    assert "hunter2" not in msg
    assert "ConnectionError" in msg


def test_wrong_password(redis_url: str) -> None:  # noqa: F811 - the imported fixture
    # The private server has no user "nobody": AUTH fails, and the error hides the password we sent.
    with closing(open_store(redis_url.replace("//", "//nobody:hunter2@"))) as s:
        assert s.ping() is False
        with pytest.raises(StoreError) as e:
            s.count_requests()
    assert "hunter2" not in str(e.value)
    assert "nobody:***@" in str(e.value)
