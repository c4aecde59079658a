"""Review 16: the live manager's periodic statistics save made the store's calls on the event loop.
A store that hangs (a Redis stopped or cut off by the network, a SQLite file another program holds
locked) held every request for the store's timeout at each save (15 s a minute with Redis, 10 s with
SQLite). `save_stats_async` (the reconciler's and the stop's save) takes what is saved on the loop
and makes the store's calls on a thread. Real components: a LiveManager over in-process device
hosts, a real SQLite store whose file another connection holds locked (BEGIN EXCLUSIVE)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import pytest
from live_helpers import AUDIO, lru_config

import manager.store.sqlite as sqlite_store
from manager.live import LiveManager
from manager.store import open_store
from manager.workers_bridge import create_pool

LOCK_S = 1.0


def test_a_save_to_a_locked_store_does_not_hold_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_S", LOCK_S)  # (10 s in the service)
    config = lru_config(tmp_path)
    db = tmp_path / "state.db"
    store = open_store(f"sqlite:///{db}")

    async def main() -> tuple[int, int]:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store)
        await lm.start()
        try:
            await lm.infer("voice", AUDIO)
            other = sqlite3.connect(db, timeout=0, isolation_level=None)
            other.execute("BEGIN EXCLUSIVE")  # another program holds the file locked
            ticks = 0

            async def ticking() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(ticking())
            try:
                await lm.save_stats_async()  # waits out the lock, off the loop
                locked_ticks = ticks
            finally:
                ticker.cancel()
                other.execute("ROLLBACK")
                other.close()
            await lm.save_stats_async()
            saved = store.get_doc("stats") or {}
            return locked_ticks, saved.get("voice", {}).get("requests", 0)
        finally:
            await lm.stop()
            pool.close()

    with caplog.at_level(logging.ERROR, logger="manager.live_persist"):
        ticks, requests = asyncio.run(main())
    store.close()
    assert ticks >= 20, ticks  # the loop ran on through the save's wait (it was held for all of it)
    assert any("could not save statistics to the store" in r.getMessage() for r in caplog.records)
    assert requests == 1  # saved once the lock was let go
