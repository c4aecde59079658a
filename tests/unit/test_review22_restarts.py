"""Review 22, restarts.

With a store that does not answer at start (a stopped Redis: 15 s a call), the start
made its store calls one after another, each waiting for its own timeout: the journal's flush, the
statistics' read, the admin pins' read, the recorded intents' read. About a minute passed before the
service served. Once the start's first call fails, the others are not tried: the statistics and the
pins are read once the store answers (as before), the intents are rewritten from the books.

The store is the real SQLite store behind a wrapper that fails every call while `down` and counts
the calls made (unit test only).

A model its device host held in host RAM at a restart was adopted at the config's estimate, not the
bytes it holds there (a read into host RAM is booked at those)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from live_helpers import TEXT, kill, local_config, lru_config, run, started, until

from manager.config import Config
from manager.live import LiveManager
from manager.store import open_store
from manager.store.base import StoreError


class _CountingDownStore:
    """The real store; while `down`, every call fails as a stopped Redis's does (StoreError), and
    while `writes_refused` every write fails as a Redis at its maxmemory refuses one (reads answer).
    Each call is counted in `calls` by name, and those made on the event loop's thread (the main
    thread here) in `on_loop`."""

    WRITES = ("append_requests", "put_doc", "set_intent")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.down = self.writes_refused = False
        self.calls: list[str] = []
        self.on_loop: list[str] = []
        self.slow: dict[str, float] = {}  # call name -> seconds it takes first

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            self.calls.append(name)
            if threading.current_thread() is threading.main_thread():
                self.on_loop.append(name)
            time.sleep(self.slow.get(name, 0.0))
            if self.down:
                raise StoreError(self.url, f"{name}: TimeoutError: Timeout reading from socket (test)")
            if self.writes_refused and name in self.WRITES:
                raise StoreError(self.url, f"{name}: ResponseError: OOM command not allowed (test)")
            return attr(*a, **k)

        return call


def _config(tmp_path: Path) -> Config:
    return local_config(tmp_path, ("voice", "embed"))


def test_a_store_down_at_start_is_asked_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    inner.put_doc("pins", {"embed": True})  # saved by the run before
    inner.set_intent("embed", "gpu")
    store = _CountingDownStore(inner)
    store.down = True

    async def body(lm: LiveManager) -> None:
        assert store.calls == ["get_doc"], store.calls  # the statistics' read, and no other
        assert store.on_loop == [], store.on_loop  # on a thread: the event loop was not held
        assert lm._stats_unread and lm._pins_unread and lm._intents_stale
        assert not lm.engine.models["embed"].pinned  # not read yet: the config's pins hold
        store.down = False  # it answers: what the start did not read is read now
        await until(lambda: lm.engine.models["embed"].pinned, "the saved pin read once the store answers")
        await until(lambda: not lm._stats_unread, "the saved statistics merged once the store answers")
        served = await asyncio.wait_for(lm.infer("embed", TEXT), 30)
        assert served.result.ok

    try:
        with caplog.at_level(logging.WARNING):
            run(config, body, store=store)
        said = caplog.text
        assert "could not read saved statistics from the store (store " in said  # the store's own error
        assert "the admin pins from the store (not tried: the store failed the statistics' read" in said
        assert "could not read the recorded intents at start (store " in said
        assert inner.intents()["embed"] == "gpu"  # rewritten from the books once it answered
    finally:
        inner.close()


def test_a_store_that_fails_the_journals_flush_at_start_is_asked_the_statistics_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed run's journal holds requests: the start's first call is their flush. It fails, then
    the statistics' read fails: the pins and intents are not read at start, and the journal's
    requests are written, and taken into the statistics, once the store answers."""
    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store = _CountingDownStore(inner)
    journal = tmp_path / "journal.jsonl"

    async def first_run() -> None:  # serves one request, and is killed before the store took it
        lm, pool = await started(config, store, journal)
        store.down = True
        served = await asyncio.wait_for(lm.infer("embed", TEXT), 30)
        assert served.result.ok
        kill(lm, pool)

    async def second_run() -> None:
        store.calls.clear()
        lm, pool = await started(config, store, journal)
        try:
            assert store.calls.count("get_doc") == 1 and "intents" not in store.calls, store.calls
            assert lm._stats_unread and lm._pins_unread and lm._log_failing
            store.down = False
            await until(lambda: not lm._log_buf and not lm._stats_unread, "the journal written and merged")
            assert lm.live["embed"].requests >= 1  # the killed run's request is in the statistics
        finally:
            await lm.stop()
            pool.close()

    try:
        asyncio.run(first_run())
        assert journal.read_text().strip(), "the killed run's request is not in its journal"
        with caplog.at_level(logging.WARNING):
            asyncio.run(second_run())
        assert "(not tried: the store failed the statistics' read at start)" in caplog.text
        assert any(r["model"] == "embed" for r in inner.requests(0.0, None))
    finally:
        inner.close()


def test_a_store_that_refuses_writes_at_start_is_still_read(tmp_path: Path) -> None:
    """A store that refuses writes but answers reads (a Redis at its maxmemory, a read-only replica)
    failed the journal's flush, and the start read nothing more: the recorded intents were not
    restored, and were then overwritten from the books (found in review of the change above)."""
    from manager.journal import RequestJournal

    config = lru_config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    inner.set_intent("embed", "gpu")  # the working set a restart brings back
    journal = RequestJournal(tmp_path / "journal.jsonl")  # a killed run left one request in it
    journal.append({"t": time.time() - 5, "model": "embed", "busy_s": 0.01, "class": "background"})
    journal.close()
    store = _CountingDownStore(inner)
    store.writes_refused = True

    async def main() -> None:
        lm, pool = await started(config, store, tmp_path / "journal.jsonl")
        try:
            assert lm._log_failing  # the flush failed
            assert "intents" in store.calls and "get_doc" in store.calls, store.calls
            assert lm.engine.models["embed"].tier.name == "GPU"  # restored from its intent
        finally:
            kill(lm, pool)

    try:
        asyncio.run(main())
    finally:
        inner.close()


def test_the_late_merge_reads_the_request_log_off_the_event_loop(tmp_path: Path) -> None:
    """With the store down at start, the statistics it holds are merged in once it answers: the
    request log's records after them were read on the event loop (a slow or large read held every
    request), though the save's other store calls were made on a thread."""
    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    inner.put_doc("stats", {})
    store = _CountingDownStore(inner)
    store.down = True

    async def body(lm: LiveManager) -> None:
        assert lm._stats_unread
        store.calls.clear()
        store.down = False
        await until(lambda: not lm._stats_unread, "the saved statistics merged")
        await until(lambda: "requests" in store.calls, "the request log read for the merge")
        assert "requests" not in store.on_loop and "get_doc" not in store.on_loop, store.on_loop

    try:
        run(config, body, store=store)
    finally:
        inner.close()


def test_a_model_held_in_host_ram_at_a_restart_is_booked_at_its_host_bytes(tmp_path: Path) -> None:
    """A restarted manager adopted a model its device host held in host RAM at the config's estimate
    (1 MiB for ~87 MiB of tensors), until a device load measured it: host RAM was booked short."""
    from manager.policy.types import Tier
    from manager.workers_bridge import create_pool

    config = _config(tmp_path)
    models = [
        m.model_copy(update={"memory": 2**20, "prewarm": False}) if m.name == "embed" else m
        for m in config.models
    ]
    config = config.model_copy(update={"models": models})

    async def main() -> None:
        pool = create_pool(config, in_process=True)  # the device host outlives both managers
        try:
            first = LiveManager(config, pool)
            await first.start()
            await first.preload("embed", "host")
            await until(lambda: not first.host_read_pending("embed"), "the read into host RAM answered")
            held = pool.status("cpu0").models["embed"]
            assert held.tier == "host" and held.host_bytes > 50 * 2**20, held
            await first.stop()

            second = LiveManager(config, pool)
            before = second.engine.host.used
            await second.start()
            try:
                m = second.engine.models["embed"]
                assert m.tier == Tier.HOST  # adopted, not read again
                assert m.weights == held.host_bytes, (m.weights, held.host_bytes)
                assert second.engine.host.used == before + held.host_bytes
            finally:
                await second.stop()
        finally:
            pool.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "key", ["old-model", "", "voice"], ids=["not-configured", "empty-name", "configured"]
)
def test_a_damaged_intent_row_is_replaced_or_removed_at_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    """A damaged intent row was said at start to be "rewritten at the next save", but the rewrite
    writes the configured models' intents only: one under another name (a model since removed, a
    damaged name) stayed, said again at every start."""
    import sqlite3

    config = _config(tmp_path)
    db = tmp_path / "state.db"
    open_store(f"sqlite:///{db}").close()
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO intents VALUES (?, 'gpuu')", (key,))  # a damaged tier
    for start in (1, 2):
        store = open_store(f"sqlite:///{db}")
        caplog.clear()

        async def body(lm: LiveManager) -> bool:
            await lm.save_stats_async()  # the next save
            return lm._intents_stale

        with caplog.at_level(logging.WARNING):
            stale = run(config, body, store=store)
        said = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
        assert not stale
        assert len(said) == (1 if start == 1 else 0), (start, said)
        intents = store.intents()
        store.close()
        assert key not in intents or intents[key] in ("gpu", "host", "disk"), intents
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT tier FROM intents WHERE model = ?", (key,)).fetchall()
    assert rows == (
        [] if key != "voice" else [(store_tier,)] if (store_tier := rows[0][0]) != "gpuu" else []
    ), rows


def _saved_once(config: Config, inner: Any) -> None:
    """An earlier run's statistics in `inner`: embed asked for once, 100 s ago."""
    first = LiveManager(config, None, store=inner)
    first.engine.observe(first.engine.models["embed"], time.time() - 100)
    inner.put_doc("stats", first._stats_doc())


def test_a_request_that_comes_during_the_start_waits_for_it(tmp_path: Path) -> None:
    """The start's store reads are made on threads, so a request the gRPC server took meanwhile ran
    between them: observed on the books before the restored statistics replaced them, its arrival
    was lost (found in review of the change above). It waits for the start's end now."""
    from manager.workers_bridge import create_pool

    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    _saved_once(config, inner)
    store = _CountingDownStore(inner)
    store.slow["get_doc"] = 1.0

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store)
        start = asyncio.ensure_future(lm.start())
        try:
            await asyncio.sleep(0.2)  # the statistics' read is under way
            request = asyncio.ensure_future(lm.infer("embed", TEXT))
            await asyncio.sleep(0.2)
            assert not request.done() and lm.engine.models["embed"].hist.count == 0  # it waits
            await start
            served = await asyncio.wait_for(request, 30)
            assert served.result.ok
            assert lm.engine.models["embed"].hist.count == 2  # the saved arrival and this one
        finally:
            await start
            await lm.stop()
            pool.close()

    try:
        asyncio.run(main())
    finally:
        inner.close()


def test_a_load_measured_during_the_late_merge_is_kept(tmp_path: Path) -> None:
    """The late merge (the store down at start) reads the request log on a thread: a load time
    measured meanwhile was dropped when the saved load times replaced the books' (found in review);
    and with nine saved samples (as many as are kept), this run's own were pushed out by the older."""
    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    first = LiveManager(config, None, store=inner)
    first.engine.observe(first.engine.models["embed"], time.time() - 100)
    for _ in range(9):  # an earlier run's nine loads
        first.engine.models["embed"].cost.measure("disk", 2.0)
    inner.put_doc("stats", first._stats_doc())
    store = _CountingDownStore(inner)
    store.down = True
    lm = LiveManager(config, None, store=store)
    lm.restore_stats()
    assert lm._stats_unread
    store.down = False
    store.slow["requests"] = 0.5  # a long request log
    m = lm.engine.models["embed"]

    async def main() -> None:
        save = asyncio.ensure_future(lm.save_stats_async())
        await until(lambda: "requests" in store.calls, "the merge's read of the request log")
        m.cost.measure("disk", 7.5)  # a load confirmed now (`_confirmed`)
        await save

    try:
        asyncio.run(main())
        assert m.cost.capture()["disk"] == [2.0] * 8 + [7.5], m.cost.capture()  # the newest kept
        assert not lm._stats_unread
    finally:
        inner.close()


def test_a_stop_during_the_starts_store_read_does_not_wait_for_it(tmp_path: Path) -> None:
    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store = _CountingDownStore(inner)
    store.slow["get_doc"] = 3.0  # a store that hangs (a stopped Redis: its timeout)

    async def main() -> float:
        lm = LiveManager(config, None, store=store)
        task = asyncio.ensure_future(lm.start())
        await until(lambda: "get_doc" in store.calls, "the statistics' read")
        t0 = time.monotonic()
        task.cancel()  # what a stop signal during the start does
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return time.monotonic() - t0

    try:
        took = asyncio.run(main())
        assert took < 1.0, took
    finally:
        inner.close()


def test_a_failed_batch_of_the_request_log_is_sent_again_as_it_was(tmp_path: Path) -> None:
    """A batch the store failed was put back in front of the newer records and sent with them: a
    different batch, which a Redis store could not tell from new records when the failed write had
    run after all (a paused Redis runs it once it resumes): its requests were logged twice."""
    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store = _CountingDownStore(inner)
    sent: list[list[float]] = []
    append = inner.append_requests
    failing = [True]

    def recording(records: Any) -> None:
        sent.append([r["t"] for r in records])
        if failing[0]:
            raise StoreError(store.url, "append requests: TimeoutError (test)")
        append(records)

    inner.append_requests = recording  # type: ignore[method-assign]
    lm = LiveManager(config, None, store=store)

    async def main() -> None:
        t0 = time.time()
        lm._log_buf = [{"t": t0 + i, "model": "embed", "busy_s": 0.1} for i in range(2)]
        await lm.flush_log()  # fails: kept for a retry
        lm._log_buf.append({"t": t0 + 5, "model": "embed", "busy_s": 0.1})  # a newer request
        failing[0] = False
        await lm.flush_log()  # the failed batch, as it was
        await lm.flush_log()  # then the newer record
        assert sent == [[t0, t0 + 1], [t0, t0 + 1], [t0 + 5]], sent

    try:
        asyncio.run(main())
        assert inner.count_requests() == 3
    finally:
        inner.close()


def test_a_stop_without_a_journal_probes_afresh_before_it_leaves_the_log(tmp_path: Path) -> None:
    """The stop reused a "silent" verdict of the reconciler's last probe; without a journal the
    buffered requests were then left unwritten though the store answered again (found in review)."""
    config = _config(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store = _CountingDownStore(inner)
    lm = LiveManager(config, None, store=store)

    async def main() -> None:
        lm._log_buf = [{"t": time.time(), "model": "embed", "busy_s": 0.1}]
        store.down = True
        await lm.flush_log()  # fails: kept
        assert await lm._store_silent()  # the reconciler's probe
        store.down = False  # it answers again, within the reuse window
        await lm.stop()

    try:
        asyncio.run(main())
        assert inner.count_requests() == 1 and not lm._log_buf
    finally:
        inner.close()
