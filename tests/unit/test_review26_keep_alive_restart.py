"""Review 26: a request's own keep-alive (Ollama's `keep_alive`) holds across a restart. The service
loads back what was resident before it stopped; before, it forgot the keep-alive the last request
gave (a model asked to stay `forever` went back to the config's keep-alive). Now the statistics
document keeps each model's, and the request log's newer records (a kill's journal) say the last
one: its own, or none (the config's again). Real components: a live manager over in-process device
hosts with the real voice model, a SQLite store and the request journal."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from live_helpers import AUDIO, CONFIG, kill, run, started

from manager.config import Config, load_config
from manager.live import LiveManager
from manager.store import open_store


def _own(lm: LiveManager) -> tuple[float | None, float | None]:
    m = lm.engine.models["voice"]
    return m.keep_alive_req, m.keep_alive_cfg


def test_a_clean_restart_keeps_the_last_requests_keep_alive(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    url = f"sqlite:///{tmp_path / 'state.db'}"

    async def serve(lm: LiveManager) -> tuple[float | None, float | None]:
        await lm.infer("voice", AUDIO, keep_alive=math.inf)
        await lm.infer("voice", AUDIO, keep_alive=3600.0)
        return _own(lm)

    async def look(lm: LiveManager) -> tuple[float | None, float | None]:
        return _own(lm)

    store = open_store(url)
    assert run(config, serve, store) == (3600.0, 3600.0)
    store.close()
    store = open_store(url)
    assert run(config, look, store) == (3600.0, 3600.0)
    store.close()


def _kill_after_forever(config: Config, url: str, journal: Path, *keep_alives: float | None) -> None:
    """A run on `url` whose last statistics save says `forever`, then requests with `keep_alives` in
    the journal only, killed."""

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = lm._next_save = math.inf  # only what the test does
        await lm.infer("voice", AUDIO, keep_alive=math.inf)
        lm.save_stats()  # the last save before the kill: forever
        await lm.flush_log()
        for keep_alive in keep_alives:
            await lm.infer("voice", AUDIO, keep_alive=keep_alive)  # in the journal only
        kill(lm, pool)
        store.close()

    asyncio.run(killed())


def test_after_a_kill_the_logs_last_record_says_it(tmp_path: Path) -> None:
    """Saved statistics say `forever`; the journal's newer records say 10 min, then none (the
    config's again); each restart takes the last one it has."""
    config = load_config(CONFIG)
    configured = config.model("voice").keep_alive
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    def killed(*keep_alives: float | None) -> None:
        _kill_after_forever(config, url, journal, *keep_alives)

    async def restarted() -> tuple[float | None, float | None]:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        try:
            return _own(lm)
        finally:
            await lm.stop()
            pool.close()
            store.close()

    killed(600.0)
    assert asyncio.run(restarted()) == (600.0, 600.0)
    killed(600.0, None)
    assert asyncio.run(restarted()) == (None, configured)
    killed()
    assert asyncio.run(restarted()) == (math.inf, math.inf)


def test_read_late_the_earlier_runs_keep_alive_holds_unless_this_run_said_otherwise(tmp_path: Path) -> None:
    """The store down at start: the statistics and the log are read once it answers again. The
    earlier run's last keep-alive holds for a model this run has not been asked for yet; a request
    this run served said the newer word."""
    from test_review12_persist import _FlakyStore, _quiet

    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    async def restarted(ask: bool, refused: bool = False) -> tuple[float | None, float | None]:
        real = open_store(url)
        store = _FlakyStore(real)
        lm, pool = await started(config, store, journal)  # the store is down at start
        _quiet(lm)
        try:
            assert _own(lm)[0] is None  # nothing read yet
            if ask:
                await lm.infer("voice", AUDIO, keep_alive=120.0)
            if refused:  # a request refused before admission (a full queue): counted by the
                voice = lm.engine.models["voice"]  # statistics, silent on the keep-alive
                lm.engine.observe(voice, lm.clock())
            store.down = False
            await lm.flush_log()  # the store answers: the log, then the statistics merged
            lm.save_stats()
            return _own(lm)
        finally:
            await lm.stop()
            pool.close()
            real.close()

    _kill_after_forever(config, url, journal, 600.0)
    assert asyncio.run(restarted(ask=False)) == (600.0, 600.0)
    _kill_after_forever(config, url, journal, 600.0)
    assert asyncio.run(restarted(ask=True)) == (120.0, 120.0)
    _kill_after_forever(config, url, journal, 600.0)
    assert asyncio.run(restarted(ask=False, refused=True)) == (600.0, 600.0)


def test_statistics_an_earlier_release_saved_take_the_keep_alive_from_the_request_log(tmp_path: Path) -> None:
    """Review 26 (upgrade): an earlier release's statistics keep no request keep-alive; the request
    log's record of the model's last request says it."""
    config = load_config(CONFIG)
    url = f"sqlite:///{tmp_path / 'state.db'}"

    async def serve(lm: LiveManager) -> None:
        await lm.infer("voice", AUDIO)
        await lm.infer("voice", AUDIO, keep_alive=10800.0)

    async def look(lm: LiveManager) -> tuple[float | None, float | None]:
        return _own(lm)

    store = open_store(url)
    run(config, serve, store)
    doc = store.get_doc("stats")
    assert doc is not None
    for entry in doc.values():  # as the earlier release wrote it
        if isinstance(entry, dict):
            entry.pop("keep_alive_req", None)
    store.put_doc("stats", doc)
    assert run(config, look, store) == (10800.0, 10800.0)
    store.close()
