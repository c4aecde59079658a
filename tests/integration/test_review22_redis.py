"""Review 22, against a real redis-server: a key of the store's that holds another program's data
(another type than the store keeps there) was said once, at the first read or write that met it, and
then read as an outage for the whole run: no statistics, pins or intents saved, every request kept in
memory only. No wait mends it, so `refused()` says it, and `serve` stops at start naming the key and
the fix, as it does for a wrong password."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from manager.store.redis import RedisStore

from .redis_server import client, redis_clean, redis_url, rstore  # noqa: F401

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
TAIL = (
    "(another program's data under the prefix 'residency'? give this store its own ?prefix=NAME in store.url)"
)


def test_a_key_of_another_type_is_a_refusal(rstore: RedisStore, client: redis.Redis) -> None:  # noqa: F811
    assert rstore.refused() is None  # empty: nothing in the way
    rstore.put_doc("stats", {"voice": {}})  # the store's own data: not a refusal
    rstore.set_intent("voice", "gpu")
    assert rstore.refused() is None
    client.set("residency:intents:x", "another program's")  # a key beside the store's: none of its own
    assert rstore.refused() is None
    client.delete("residency:docs")
    client.rpush("residency:docs", "another program's list")
    assert rstore.refused() == f"WRONGTYPE: residency:docs holds a list, not a hash {TAIL}"


@pytest.mark.timeout(120)
def test_serve_stops_at_start_naming_the_key(
    redis_clean: str,  # noqa: F811
    client: redis.Redis,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: `serve` started and served, saying once that the statistics could not be read."""
    import manager.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "false")
    client.set("residency:docs", "another program's string")
    config = tmp_path / "c.yaml"
    config.write_text(f'store: {{url: "{redis_clean}"}}\n' + CONFIG.read_text())
    rc = cli.main(["serve", "--config", str(config), "--in-process", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "residency:docs holds a string, not a hash" in last and "?prefix=NAME" in last, err
    assert "Traceback" not in err and "serving on" not in err
    assert client.get("residency:docs") == b"another program's string"  # left as it was


def test_a_damaged_intent_is_named_with_its_key_and_can_be_dropped(
    rstore: RedisStore,  # noqa: F811
    client: redis.Redis,  # noqa: F811
) -> None:
    from manager.store.base import CorruptRow

    rstore.set_intent("voice", "gpu")
    client.hset("residency:intents", "old-model", "gpuu")
    damaged: list[object] = []
    intents = rstore.intents(on_corrupt=lambda e: damaged.append(e.key if isinstance(e, CorruptRow) else e))
    assert intents == {"voice": "gpu"}
    assert damaged == [b"old-model"], damaged  # (the key as stored: the client reads bytes)
    for key in damaged:
        rstore.drop_intent(key)
    assert client.hgetall("residency:intents") == {b"voice": b"gpu"}
    rstore.drop_intent("never-recorded")  # nothing to drop: nothing happens
    assert rstore.intents() == {"voice": "gpu"}
