"""Review 22, against a real redis-server: a key of the store's that holds another program's data
(another type than the store keeps there) was said once, at the first read or write that met it, and
then read as an outage for the whole run: no statistics, pins or intents saved, every request kept in
memory only. No wait mends it, so `refused()` says it, and `serve` stops at start naming the key and
the fix, as it does for a wrong password."""

from __future__ import annotations

from contextlib import closing
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


def test_a_damaged_intent_of_a_configured_model_is_replaced_not_dropped(
    redis_clean: str,  # noqa: F811
    client: redis.Redis,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Redis gives its keys as bytes: the save rewrote a configured model's damaged intent, then
    dropped its key as one naming no configured model, deleting the intent it had just written
    (found in review)."""
    import asyncio

    from manager.config import load_config
    from manager.live import LiveManager
    from manager.store import open_store

    config = load_config(CONFIG)
    client.hset("residency:intents", "voice", "gpuu")  # damaged
    store = open_store(redis_clean)
    try:
        lm = LiveManager(config, None, store=store)
        assert lm._read_intents() == {} and lm._intents_stale
        asyncio.run(lm.save_stats_async())
        assert not lm._intents_stale
        assert store.intents().get("voice") in ("gpu", "host", "disk"), store.intents()
    finally:
        store.close()


def test_a_paused_redis_holds_the_start_for_one_short_probe(tmp_path: Path) -> None:
    """A Redis that hangs (paused: SIGSTOP) held `serve`'s start for three 15 s timeouts before it even
    listened (`refused`'s PING, retried), then one more for the journal's flush and one for the
    statistics' read: 33 to 49 s before it served (found in a walkthrough). The first probe now waits
    2 s, once, and a store that did not answer it is not asked the start's reads."""
    import asyncio
    import os
    import shutil
    import signal
    import time

    from manager.config import load_config
    from manager.live import LiveManager
    from manager.store import open_store
    from manager.workers_bridge import create_pool

    from .redis_server import _start, _stop

    exe = shutil.which("redis-server")
    assert exe is not None
    proc, port = _start(exe, tmp_path)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        with closing(open_store(url)) as live:
            assert live.refused() is None and live.answered is True
            live.put_doc("pins", {"embed": True})  # an earlier run's admin pin
        os.kill(proc.pid, signal.SIGSTOP)
        store = open_store(url, hold=True)
        began = time.monotonic()
        assert store.refused() is None  # down: an outage, not a refusal
        probe = time.monotonic() - began
        assert probe < 4.0 and store.answered is False, probe
        config = load_config(CONFIG)

        async def main() -> float:
            pool = create_pool(config, in_process=True)
            lm = LiveManager(config, pool, store=store)
            began = time.monotonic()
            await lm.start()
            took = time.monotonic() - began
            try:
                assert lm._stats_unread and lm._pins_unread and lm._intents_stale
                os.kill(proc.pid, signal.SIGCONT)  # it answers again: what the start did not read is read
                deadline = time.monotonic() + 60
                while not lm.engine.models["embed"].pinned and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert lm.engine.models["embed"].pinned, "the saved pin was not read once the store answered"
            finally:
                await lm.stop()
                pool.close()
            return took

        took = asyncio.run(main())
        assert took < 10.0, took  # (a load or two of the example config's models, no store timeout)
        store.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _stop(proc)


def test_a_stop_with_a_paused_redis_leaves_its_requests_in_the_journal(tmp_path: Path) -> None:
    """With a Redis that hangs, the stop waited for each of its writes' timeouts (the pins, the request
    log, the statistics): 32 s, past a container's 10 s stop grace (found in a walkthrough). Now a
    store that failed lately and does not answer a 2 s probe is left as a kill leaves it: the journal
    keeps the requests, written at the next start."""
    import asyncio
    import os
    import shutil
    import signal
    import time

    import numpy as np

    from manager.config import load_config
    from manager.live import LiveManager
    from manager.store import open_store
    from manager.workers_bridge import create_pool

    from .redis_server import _start, _stop

    exe = shutil.which("redis-server")
    assert exe is not None
    proc, port = _start(exe, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    config = load_config(CONFIG)
    journal = tmp_path / "journal.jsonl"

    async def run(paused: bool) -> float:
        store = open_store(url, hold=True)
        store.refused()
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, journal=journal)
        await lm.start()
        try:
            if paused:
                text = {"text": np.array([b"turn on the lights"], dtype=object)}
                served = await asyncio.wait_for(lm.infer("embed", text), 60)
                assert served.result.ok
        finally:
            began = time.monotonic()
            await lm.stop()
            took = time.monotonic() - began
            pool.close()
            store.close()
        return took

    try:
        os.kill(proc.pid, signal.SIGSTOP)
        took = asyncio.run(run(paused=True))
        assert took < 8.0, took
        assert any('"embed"' in line for line in journal.read_text().splitlines()), "not in the journal"
        os.kill(proc.pid, signal.SIGCONT)
        asyncio.run(run(paused=False))  # the next start writes it
        with closing(open_store(url)) as s:
            assert [r["model"] for r in s.requests(0.0, None)] == ["embed"]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _stop(proc)


def test_the_same_batch_sent_again_is_written_once(rstore: RedisStore) -> None:  # noqa: F811
    """A write that timed out against a paused Redis sits in its socket and runs when Redis resumes;
    the service's retry of the batch, under a new token, wrote its requests a second time (found in a
    walkthrough: 19 entries for 18 requests after a 20 s pause). A batch is marked by its own digest
    now, and the service sends a failed batch again as it was (tests/unit/test_review22_restarts.py):
    the copy that runs second writes nothing."""
    batch = [{"t": 1_800_000_000.0 + i, "model": "voice", "busy_s": 0.4} for i in range(3)]
    rstore.append_requests(batch)
    rstore.append_requests(batch)  # the service's retry, the first copy having run after all
    assert rstore.count_requests() == 3
    rstore.append_requests(batch[:2])  # another batch: written
    assert rstore.count_requests() == 5


def test_a_probe_uses_no_connection_of_the_clients_pool(rstore: RedisStore) -> None:  # noqa: F811
    """Each probe took a connection of the client's pool for good: after 100 (one a second through an
    outage) the pool was spent, the probe raised, and the store read as silent for the run (found in
    review)."""
    for _ in range(120):
        assert rstore.refused() is None and rstore.answered is True
    rstore.put_doc("x", {"ok": True})
    assert rstore.get_doc("x") == {"ok": True}
