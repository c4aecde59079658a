"""Review 21: a store that hangs (a stopped Redis: each call waits for its 15 s timeout) held the
reconciler in its request-log flush and statistics save, so it took no device host's results
meanwhile: the first request after a start waited about a minute for a model its host had loaded in
a second. The store's work now runs beside the reconciler.

The store here is the real SQLite store whose statistics write hangs, off the event loop's thread
(where the reconciler's store calls run), until the test lets it go."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from live_helpers import TEXT, local_config, until

from manager.config import Config
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.store.sqlite import SQLiteStore, parse_sqlite_url
from manager.workers_bridge import create_pool


class _HungSQLiteStore(SQLiteStore):
    """The real store, but one kind of write (`hang`: "stats", the statistics document, or "intent")
    made off the main thread waits for `go` (unit test only)."""

    def __init__(self, url: str, hang: str) -> None:
        super().__init__(parse_sqlite_url(url), url=url)  # (a path: the url is no folder)
        self.hang = hang
        self.hanging = threading.Event()
        self.go = threading.Event()

    def _wait(self, what: str) -> None:
        if what == self.hang and threading.current_thread() is not threading.main_thread():
            self.hanging.set()
            self.go.wait(60)

    def put_doc(self, key: str, doc: Any) -> None:
        self._wait(key)
        super().put_doc(key, doc)

    def set_intent(self, model: str, tier: str) -> None:
        self._wait("intent")
        super().set_intent(model, tier)


def _config(tmp_path: Path) -> Config:
    """voice and embed of configs/local-cpu.yaml, embed not prewarmed (its first request loads it)."""
    config = local_config(tmp_path, ("voice", "embed"))
    models = [m.model_copy(update={"prewarm": False}) if m.name == "embed" else m for m in config.models]
    return config.model_copy(update={"models": models})


def _with_hung_store(
    tmp_path: Path, hang: str, body: Callable[[LiveManager, _HungSQLiteStore], Awaitable[None]]
) -> None:
    """`body(manager, store)` on a started manager over in-process hosts whose store hangs in the
    writes of `hang` once one is made off the main thread; all let go and stopped after."""
    config = _config(tmp_path)
    store = _HungSQLiteStore(config.store.url, hang)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store)
        await lm.start()
        try:
            assert await asyncio.to_thread(store.hanging.wait, 30), f"no {hang} write was made"
            assert lm.engine.models["embed"].tier != Tier.GPU  # (prewarm: false)
            await body(lm, store)
        finally:
            store.go.set()
            await lm.stop()
            pool.close()

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_a_request_is_served_while_a_store_write_hangs(tmp_path: Path) -> None:
    async def body(lm: LiveManager, store: _HungSQLiteStore) -> None:
        # (the reconciler's first save is due at once: it hangs in the statistics write)
        served = await asyncio.wait_for(lm.infer("embed", TEXT), 30)
        assert served.result.ok and served.cold, served  # its load's result was taken meanwhile
        assert not store.go.is_set()  # served while the store's write still hung
        assert lm._persisting is not None and not lm._persisting.done()

    _with_hung_store(tmp_path, "stats", body)


def test_an_intent_write_that_hangs_holds_no_request(tmp_path: Path) -> None:
    """An intent was written on the event loop: a store that hangs held the loop, and every request,
    for its timeout at the first write after it stopped answering."""

    async def body(lm: LiveManager, store: _HungSQLiteStore) -> None:
        # (the pinned voice's load at the start: its intent's write hangs)
        served = await asyncio.wait_for(lm.infer("embed", TEXT), 30)
        assert served.result.ok and served.cold, served
        assert not store.go.is_set()  # served while the intent's write still hung
        assert "embed" in lm._intents_pending  # its own intent waits its turn
        store.go.set()
        await until(lambda: store.intents().get("embed") == "gpu", "embed's intent written")

    _with_hung_store(tmp_path, "intent", body)
