"""The live manager's persistence, with real models on in-process device hosts (no Ray, no sockets):
statistics and the request log across restarts and kills, the journal, and store outages."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import AUDIO, CONFIG, kill, lru_config, run, started

from manager.config import load_config
from manager.live import LiveManager
from manager.policy.stats import LoadCost, ReuseHistogram
from manager.store import open_store


def test_statistics_and_the_request_log_survive_a_restart(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    url = f"sqlite:///{tmp_path / 'state.db'}"

    async def serve_some(lm: LiveManager) -> tuple[int, dict[str, float], float]:
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        voice = lm.engine.models["voice"]
        return voice.hist.count, voice.cost.as_dict(), voice.last_arrival

    store = open_store(url)
    count, cost, last = run(config, serve_some, store)
    store.close()

    async def look(lm: LiveManager) -> tuple[int, dict[str, float], int, float]:
        return (
            lm.engine.models["voice"].hist.count,
            lm.engine.models["voice"].cost.as_dict(),
            lm.live["voice"].requests,
            lm.engine.models["voice"].last_arrival,
        )

    store = open_store(url)
    assert store.intents()["voice"] == "gpu"  # intent kept for reconciliation
    count2, cost2, requests, last2 = run(config, look, store)
    assert store.count_requests() == 3
    assert [r["model"] for r in store.requests(0)] == ["voice"] * 3
    store.close()
    assert (count2, requests) == (count, 3)
    assert last2 == last  # idle since the last request before the restart, not "never asked"
    assert cost2["disk"] == pytest.approx(cost["disk"], rel=0.5)


def test_histogram_and_cost_capture_round_trip() -> None:
    h = ReuseHistogram()
    for t in (1000.0, 1030.0, 1100.0, 5000.0):
        h.observe(t)
    h2 = ReuseHistogram()
    h2.restore(h.capture())
    assert h2.capture() == h.capture() and h2.quantile(0.5) == h.quantile(0.5)
    c = LoadCost(3.0, 1.0, 0.5)
    for x in (2.0, 2.2, 2.4):
        c.measure("disk", x)
    c2 = LoadCost(3.0, 1.0, 0.5)
    c2.restore(c.capture())
    assert c2.as_dict() == c.as_dict()
    with pytest.raises(ValueError, match="wrong shape"):
        ReuseHistogram().restore({**h.capture(), "bins": [1, 2]})


class _FlakyStore:
    """Fault injector (unit tests only) around the real SQLite store: every call fails while `down`."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.down = True
        self.calls: dict[str, int] = {}  # method -> calls, failed or not

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.down:
                from manager.store import StoreError

                raise StoreError(self.real.url, "connection refused (injected)")
            return target(*args, **kwargs)

        return call


def test_the_store_down_at_start_and_while_serving_loses_nothing_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import manager.live_persist as persist_mod  # where the request log's bound is read

    store = _FlakyStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    monkeypatch.setattr(persist_mod, "LOG_KEEP", 5)

    async def body(lm: LiveManager) -> None:
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        await lm.flush_log()  # store down: kept
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 3
        for _ in range(4):
            await lm.infer("voice", AUDIO)
        await lm.flush_log()  # 7 waiting, bound 5: the 2 oldest go, and the metric says so
        assert lm.metrics.registry.get_sample_value("residency_request_log_dropped_total") == 2
        store.down = False
        await lm.flush_log()
        assert store.real.count_requests() == 5
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 0

    run(load_config(CONFIG), body, store)  # it started although the store was down
    store.real.close()


def test_past_the_bound_the_records_of_requests_that_never_ran_go_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 31: refusals are logged too (`outcome` rejected), so a client retrying a refusal in a
    loop while the store is down would push the requests that ran out of the bounded buffer; the
    records of requests that never ran go first."""
    import manager.live_persist as persist_mod

    store = _FlakyStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    monkeypatch.setattr(persist_mod, "LOG_KEEP", 5)

    async def body(lm: LiveManager) -> None:
        await lm.infer("voice", AUDIO)
        for _ in range(4):  # (refusals' records, as `_log_unserved` writes them)
            lm._log({"t": lm.clock(), "model": "voice", "busy_s": 0.0, "wait_s": 0.0, "outcome": "rejected"})
        for _ in range(2):
            await lm.infer("voice", AUDIO)
        await lm.flush_log()  # 7 waiting, bound 5: two of the refusals go, not the oldest request
        assert lm.metrics.registry.get_sample_value("residency_request_log_dropped_total") == 2
        store.down = False
        await lm.flush_log()
        outcomes = [r.get("outcome") for r in store.real.requests(0)]
        assert outcomes.count("ok") == 3 and outcomes.count("rejected") == 2

    run(load_config(CONFIG), body, store)
    store.real.close()


def test_a_store_down_costs_a_ping_a_second_not_the_batch_on_every_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import manager.live as live_mod

    store = _FlakyStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    monkeypatch.setattr(live_mod, "LOG_BATCH", 2)  # a full batch would be retried on every poll
    monkeypatch.setattr(live_mod, "LOG_EVERY_S", 0.2)

    async def body(lm: LiveManager) -> None:
        for _ in range(5):
            await lm.infer("voice", AUDIO)
        writes, pings = store.calls.get("append_requests", 0), store.calls.get("ping", 0)
        t0 = lm.clock()
        while lm.clock() - t0 < 1.0:  # the reconciler runs on its own for a second (200 polls)
            await asyncio.sleep(0.05)
        took = lm.clock() - t0  # (more than a second on a loaded machine: its pings are counted by it)
        assert store.calls.get("append_requests", 0) <= writes + 1  # at most one more full try
        assert store.calls.get("ping", 0) >= 2
        # then a ping each LOG_EVERY_S, not a try at each of the reconciler's polls
        assert store.calls.get("ping", 0) - pings <= took / 0.2 + 2
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 5
        store.down = False
        t0 = lm.clock()
        while store.real.count_requests() < 5 and lm.clock() - t0 < 5.0:
            await asyncio.sleep(0.05)
        assert store.real.count_requests() == 5  # written by the reconciler once the store is back
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 0
        assert lm.metrics.registry.get_sample_value("residency_request_log_dropped_total") == 0

    run(load_config(CONFIG), body, store)
    store.real.close()


def test_started_with_the_store_down_it_merges_the_saved_statistics_and_rewrites_intents(
    tmp_path: Path,
) -> None:
    config = load_config(CONFIG)
    real = open_store(f"sqlite:///{tmp_path / 'state.db'}")

    async def earlier_run(lm: LiveManager) -> None:
        for _ in range(3):
            await lm.infer("voice", AUDIO)

    run(config, earlier_run, real)  # stop() saved the statistics: 3 voice requests
    saved = real.get_doc("stats")
    assert saved is not None and saved["voice"]["requests"] == 3
    real.set_intent("voice", "disk")  # what the store says is stale: this run must correct it
    store = _FlakyStore(real)

    async def body(lm: LiveManager) -> None:
        for _ in range(2):
            await lm.infer("voice", AUDIO)
        lm.save_stats()  # still down: nothing is overwritten
        assert real.get_doc("stats")["voice"]["requests"] == 3
        store.down = False
        await lm.flush_log()  # the store answers again: log, intents and merged statistics
        assert real.count_requests() == 5
        assert real.intents()["voice"] == "gpu"
        doc = real.get_doc("stats")
        assert doc["voice"]["requests"] == 5  # the earlier run's 3 and this run's 2
        assert doc["voice"]["hist"]["count"] == saved["voice"]["hist"]["count"] + 2
        assert sum(doc["voice"]["hist"]["arrivals_hod"]) == sum(saved["voice"]["hist"]["arrivals_hod"]) + 2
        assert lm.live["voice"].requests == 5

    run(config, body, store)
    real.close()


def test_a_killed_service_loses_no_served_request(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = math.inf  # (before the reconciler first runs) it never writes the log in time
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        kill(lm, pool)
        assert store.count_requests() == 0
        store.close()

    asyncio.run(killed())
    with journal.open("a") as f:
        f.write('{"t": 1, "model": "voi')  # a torn last line, as a crash can leave

    async def restarted() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        assert store.count_requests() == 3 and lm.journal is not None and lm.journal.skipped == 1
        await lm.stop()
        assert journal.read_text() == ""  # everything is in the store now
        pool.close()
        store.close()

    asyncio.run(restarted())


def test_the_request_log_and_its_journal_hold_no_payloads(tmp_path: Path) -> None:
    from manager.store.base import RECORD_FIELDS

    config = load_config(CONFIG)
    db, journal = tmp_path / "state.db", tmp_path / "requests.journal"
    audio = np.full(1024, 1234.5678, dtype=np.float32)
    sentence = b"the door code is 4711-secret"

    async def body() -> None:
        store = open_store(f"sqlite:///{db}")
        lm, pool = await started(config, store, journal)
        lm._next_flush = math.inf  # the records wait in the journal first
        await lm.infer("voice", {"audio": audio})
        await lm.infer("embed", {"text": np.array([sentence], dtype=object)})
        written = journal.read_bytes()
        assert written.count(b"\n") == 2
        await lm.stop()  # flushes the log to the store
        records = list(store.requests(0))
        assert [r["model"] for r in records] == ["voice", "embed"]
        assert all(set(r) <= set(RECORD_FIELDS) for r in records), records  # trace form + wait/outcome
        pool.close()
        store.close()
        for blob in (written, db.read_bytes()):
            assert audio[:4].tobytes() not in blob and sentence not in blob

    asyncio.run(body())


def test_a_killed_service_keeps_its_statistics_up_to_date(tmp_path: Path) -> None:
    config = lru_config(tmp_path)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = lm._next_save = math.inf  # (before the reconciler first runs) only what
        for _ in range(2):  # this test does: no periodic saves or log writes
            await lm.infer("voice", AUDIO)
        lm.save_stats()  # the last periodic save before the kill: 2 requests
        await lm.flush_log()
        for _ in range(3):
            await lm.infer("voice", AUDIO)  # in the journal only
        kill(lm, pool)
        store.close()

    asyncio.run(killed())

    store = open_store(url)
    assert store.get_doc("stats")["voice"]["requests"] == 2  # type: ignore[index]

    async def restarted() -> None:
        lm, pool = await started(config, store, journal)  # the journal's 3 requests go to the store,
        # then into the statistics
        voice = lm.engine.models["voice"]
        assert lm.live["voice"].requests == 5 and voice.hist.count == 5
        assert lm.live["voice"].last_used >= voice.hist.last_t
        await lm.stop()
        pool.close()

    asyncio.run(restarted())
    assert store.count_requests() == 5
    assert store.get_doc("stats")["voice"]["requests"] == 5  # type: ignore[index]
    store.close()


def test_a_record_the_store_refuses_is_dropped_and_the_rest_are_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One bad record (a journal line from an older or damaged run, say) made the store refuse the
    whole batch, which was kept and retried for good: nothing after it reached the store."""
    config = load_config(CONFIG)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")

    async def body(lm: LiveManager) -> None:
        lm._log({"t": 1.0, "model": "voice", "busy_s": -1.0})  # negative: the store refuses it
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        await lm.flush_log()
        await lm.flush_log()  # the good ones, put back by the first
        assert store.count_requests() == 3 and lm._log_buf == []
        assert lm.metrics.registry.get_sample_value("residency_request_log_dropped_total") == 1.0

    with caplog.at_level("WARNING", logger="manager.live"):
        run(config, body, store)
    assert "dropped: the store cannot take it" in caplog.text
    store.close()


def test_a_wall_clock_step_back_logs_no_negative_wait(tmp_path: Path) -> None:
    """A step back between a request's arrival and its start gave a negative wait_s, which the store
    refuses (and, before the fix above, held back every later record)."""
    import time

    config = load_config(CONFIG)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    offset = [0.0]

    def clock() -> float:
        return time.time() + offset[0]

    async def main() -> None:
        from manager.workers_bridge import create_pool

        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, clock=clock)
        await lm.start()
        try:
            await lm.infer("voice", AUDIO)
            real_queue = lm._queue_for

            async def queue_then_step_back(*a: Any, **k: Any) -> Any:
                got = await real_queue(*a, **k)
                offset[0] -= 0.5  # NTP steps the wall clock back after the arrival is taken
                return got

            lm._queue_for = queue_then_step_back  # type: ignore[method-assign]
            served = await lm.infer("voice", AUDIO)
            assert served.wait_s >= 0.0
            await lm.flush_log()
        finally:
            await lm.stop()
            pool.close()
        recs = list(store.requests(0))
        assert len(recs) == 2 and all(r["wait_s"] >= 0 and r["busy_s"] >= 0 for r in recs)

    asyncio.run(main())
    store.close()


def test_the_journal_stays_bounded_through_a_long_store_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffer kept the newest LOG_KEEP records, but the journal kept every request of the outage,
    all of it read back into memory at the next start (found in review, 2026-12-01)."""
    import manager.live_persist as persist_mod

    monkeypatch.setattr(persist_mod, "LOG_KEEP", 4)
    store = _FlakyStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    journal = tmp_path / "requests.journal"

    async def main() -> None:
        lm, pool = await started(load_config(CONFIG), store, journal)
        try:
            for _ in range(20):
                await lm.infer("voice", AUDIO)
                await lm.flush_log()  # the store is down: kept, the oldest dropped past 4
            lines = [x for x in journal.read_text().splitlines() if x.strip()]
            assert len(lines) <= 2 * 4 + 1 and len(lm._log_buf) == 4
            assert [json.loads(x)["t"] for x in lines[-4:]] == [r["t"] for r in lm._log_buf]
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())
    store.real.close()
